// The all-gather dispatcher (the HF transformers EP scheme); see dispatcher.h.
#include <ATen/ATen.h>

#include "parallel/differentiable_collectives.h"
#include "parallel/dispatcher.h"
#include "parallel/internal/dispatchers.h"
#include "parallel/progress.h"
#include "router/router_parallel.h"

namespace moefit::parallel {
namespace {

struct AllGatherRoute final : Route {
  at::Tensor assignment_idx;  // [R] global flat assignment of each local row
  at::Tensor token_idx;       // [R] its token among all ranks' (assignment / k)
  at::Tensor weights;         // [N_all, k] all ranks' routing weights (autograd-tracked)
  std::vector<int64_t> tokens_per_rank;
};

class AllGatherDispatcher final : public Dispatcher {
 public:
  AllGatherDispatcher(std::shared_ptr<Communicator> ep, const router::ExpertPlacement& placement)
      : ep_(std::move(ep)),
        remap_(placement, ep_->rank()),
        num_local_(placement.num_local(ep_->rank())) {}

  std::string_view name() const override { return "allgather"; }

  DispatchedRows Dispatch(const at::Tensor& x, const at::Tensor& topk_idx,
                          const at::Tensor& topk_weight) override {
    ScopedPhase phase("dispatch");
    const int world = ep_->size();
    const int64_t k = topk_idx.size(1);
    at::Tensor n_all = at::empty({world}, at::kLong);
    ep_->AllGather(at::full({1}, x.size(0), at::kLong), n_all)->WaitOrThrow();
    std::vector<int64_t> tokens(n_all.data_ptr<int64_t>(), n_all.data_ptr<int64_t>() + world);
    at::Tensor x_all = AllGatherRows(*ep_, x, tokens);
    at::Tensor idx_all = at::empty({x_all.size(0), k}, at::kLong);
    ep_->AllGatherV(topk_idx.contiguous(), idx_all, tokens)->WaitOrThrow();

    // Keep the assignments of this rank's experts, grouped by local expert.
    at::Tensor local = remap_.LocalExpertIndex(idx_all).reshape({-1});
    at::Tensor mine = at::nonzero(local >= 0).reshape({-1});
    at::Tensor mine_local = local.index_select(0, mine);
    at::Tensor order = std::get<1>(at::sort(mine_local, /*stable=*/true, 0, false));

    auto route = std::make_unique<AllGatherRoute>();
    route->assignment_idx = mine.index_select(0, order);
    route->token_idx = at::div(route->assignment_idx, k, "floor");
    route->weights = AllGatherRows(*ep_, topk_weight, tokens);
    route->tokens_per_rank = tokens;
    DispatchedRows out;
    // The rows of the tokens that visit this rank's experts, once each (not
    // all tokens: the experts' saved input stays at most one row per
    // assignment); computation row a reads row_index[a] of them.
    auto [tokens_here, slot_of] =
        at::_unique(route->token_idx, /*sorted=*/true, /*return_inverse=*/true);
    out.rows = x_all.index_select(0, tokens_here);
    out.row_index = slot_of;
    // Token row u's slot j, if one of this rank's experts, is computation
    // row copies[u, j].
    at::Tensor copies = at::full({tokens_here.numel() * k}, -1, at::kLong);
    at::Tensor where = slot_of * k + route->assignment_idx.remainder(k);
    copies.index_put_({where}, at::arange(route->assignment_idx.numel(), at::kLong));
    out.row_copies = copies.view({tokens_here.numel(), k});
    at::Tensor counts = at::bincount(mine_local, {}, num_local_);
    out.counts.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + num_local_);
    out.sent_rows = x.size(0);
    out.route = std::move(route);
    return out;
  }

  at::Tensor Combine(const at::Tensor& y, const Route& r) override {
    ScopedPhase phase("combine");
    const auto& route = static_cast<const AllGatherRoute&>(r);
    const at::ScalarType dtype = at::promote_types(y.scalar_type(), at::kFloat);
    at::Tensor weight = route.weights.reshape({-1}).index_select(0, route.assignment_idx).to(dtype);
    at::Tensor partial = at::zeros({route.weights.size(0), y.size(1)}, y.options().dtype(dtype))
                             .index_add(0, route.token_idx, y.to(dtype) * weight.unsqueeze(1));
    return SumKeepOwnRows(*ep_, partial, route.tokens_per_rank);
  }

 private:
  std::shared_ptr<Communicator> ep_;
  router::RouterParallel remap_;
  int64_t num_local_ = 0;
};

}  // namespace

std::unique_ptr<Dispatcher> CreateAllGatherDispatcher(std::shared_ptr<Communicator> ep,
                                                      const router::ExpertPlacement& placement) {
  return std::make_unique<AllGatherDispatcher>(std::move(ep), placement);
}

}  // namespace moefit::parallel
