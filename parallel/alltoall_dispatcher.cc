// The deduplicated all-to-all dispatcher (RouterParallel remapping); see
// dispatcher.h.
#include <ATen/ATen.h>

#include "parallel/differentiable_collectives.h"
#include "parallel/dispatcher.h"
#include "parallel/internal/dispatchers.h"
#include "parallel/internal/row_ops.h"
#include "parallel/progress.h"
#include "router/router_parallel.h"

namespace moefit::parallel {
namespace {

using internal::RowRelation;

struct AllToAllRoute final : Route {
  std::vector<int64_t> send_pairs, recv_pairs;  // rows per peer
  RowRelation home;                             // this rank's tokens -> the rows they sent
  RowRelation remote;  // received rows -> their computation rows, one per local expert
  at::Tensor weights;  // [received, k] routing weights (autograd-tracked)
};

class AllToAllDispatcher final : public Dispatcher {
 public:
  AllToAllDispatcher(std::shared_ptr<Communicator> ep, const router::ExpertPlacement& placement)
      : ep_(std::move(ep)),
        remap_(placement, ep_->rank()),
        num_local_(placement.num_local(ep_->rank())) {}

  std::string_view name() const override { return "alltoall"; }

  DispatchedRows Dispatch(const at::Tensor& x, const at::Tensor& topk_idx,
                          const at::Tensor& topk_weight) override {
    ScopedPhase phase("dispatch");
    const int world = ep_->size();
    const int64_t k = topk_idx.size(1);
    router::OwnerRoutes routes = remap_.RouteByOwner(topk_idx);
    auto route = std::make_unique<AllToAllRoute>();
    route->send_pairs = routes.per_owner;
    at::Tensor send_counts = at::tensor(routes.per_owner, at::kLong).view({world, 1});
    at::Tensor recv_counts = at::empty_like(send_counts);
    ep_->AllToAllCounts(send_counts, recv_counts)->WaitOrThrow();
    route->recv_pairs.assign(recv_counts.data_ptr<int64_t>(),
                             recv_counts.data_ptr<int64_t>() + world);

    // Token t's row to owner q is sent row pair_of[t, q].
    const int64_t sent = routes.tokens.numel();
    route->home = internal::MakeRowRelation(routes.pair_of, sent);

    // The rows (read where they lie in x), their routing weights and their
    // experts' local indices.
    at::Tensor rows = SendRows(*ep_, x, route->home, route->send_pairs, route->recv_pairs);
    route->weights = SendRows(*ep_, topk_weight, route->home, route->send_pairs, route->recv_pairs);
    at::Tensor local = at::empty({rows.size(0), k}, at::kLong);
    ep_->AllToAllV(routes.local_expert, route->send_pairs, local, route->recv_pairs)->WaitOrThrow();

    // A computation row per (received row, local expert it visits), grouped
    // by expert (a counting sort: arrival order within an expert); the
    // experts read the received row by index.
    const int64_t* lp = local.data_ptr<int64_t>();
    std::vector<int64_t> counts(num_local_, 0);
    for (int64_t i = 0; i < local.numel(); ++i) {
      if (lp[i] >= 0) ++counts[lp[i]];
    }
    std::vector<int64_t> next(num_local_, 0);
    for (int64_t e = 1; e < num_local_; ++e) next[e] = next[e - 1] + counts[e - 1];
    const int64_t copies = num_local_ == 0 ? 0 : next.back() + counts.back();
    at::Tensor position = at::full_like(local, -1);
    int64_t* pp = position.data_ptr<int64_t>();
    for (int64_t i = 0; i < local.numel(); ++i) {
      if (lp[i] >= 0) pp[i] = next[lp[i]]++;
    }
    route->remote = internal::MakeRowRelation(position, copies);

    DispatchedRows out;
    out.rows = rows;
    out.row_index = internal::GroupOf(route->remote);
    out.row_copies = route->remote.members;
    out.counts = std::move(counts);
    out.sent_rows = sent;
    out.route = std::move(route);
    return out;
  }

  at::Tensor Combine(const at::Tensor& y, const Route& r) override {
    ScopedPhase phase("combine");
    const auto& route = static_cast<const AllToAllRoute&>(r);
    // Each received row's weighted sum over the experts it visited here, sent
    // back and summed over the ranks it went to.
    at::Tensor partial = internal::Collect(y, route.remote, route.weights);
    return ReturnRows(*ep_, partial, route.home, route.recv_pairs, route.send_pairs);
  }

 private:
  std::shared_ptr<Communicator> ep_;
  router::RouterParallel remap_;
  int64_t num_local_ = 0;
};

}  // namespace

std::unique_ptr<Dispatcher> CreateAllToAllDispatcher(std::shared_ptr<Communicator> ep,
                                                     const router::ExpertPlacement& placement) {
  return std::make_unique<AllToAllDispatcher>(std::move(ep), placement);
}

}  // namespace moefit::parallel
