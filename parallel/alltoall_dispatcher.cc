// The all-to-all dispatcher (RouterParallel remapping); see dispatcher.h.
#include <ATen/ATen.h>

#include "parallel/differentiable_collectives.h"
#include "parallel/dispatcher.h"
#include "parallel/internal/dispatchers.h"
#include "parallel/progress.h"
#include "router/router_parallel.h"

namespace moefit::parallel {
namespace {

struct AllToAllRoute final : Route {
  at::Tensor inverse_order;                   // flat assignment -> sorted position
  std::vector<int64_t> send_rows, recv_rows;  // per peer
};

class AllToAllDispatcher final : public Dispatcher {
 public:
  AllToAllDispatcher(std::shared_ptr<Communicator> ep, const router::ExpertPlacement& placement)
      : ep_(std::move(ep)),
        remap_(placement, ep_->rank()),
        max_local_(placement.max_local()),
        num_local_(placement.num_local(ep_->rank())) {}

  std::string_view name() const override { return "alltoall"; }

  DispatchedRows Dispatch(const at::Tensor& x, const at::Tensor& topk_idx) override {
    ScopedPhase phase("dispatch");
    const int world = ep_->size();
    const int64_t k = topk_idx.size(1);
    // RouterParallel remap: rows grouped by owner, then by its local expert.
    router::OwnerOrder remap = remap_.SortByOwner(topk_idx);
    const at::Tensor& order = remap.order;
    const at::Tensor& send_matrix = remap.counts;
    at::Tensor recv_matrix = at::empty_like(send_matrix);
    ep_->AllToAllCounts(send_matrix, recv_matrix)->WaitOrThrow();

    auto route = std::make_unique<AllToAllRoute>();
    // The inverse permutation, by scatter (linear) rather than a second sort.
    route->inverse_order = at::empty_like(order).index_put_({order}, at::arange(order.numel(), order.options()));
    at::Tensor send_rows = send_matrix.sum(1), recv_rows = recv_matrix.sum(1);
    route->send_rows.assign(send_rows.data_ptr<int64_t>(), send_rows.data_ptr<int64_t>() + world);
    route->recv_rows.assign(recv_rows.data_ptr<int64_t>(), recv_rows.data_ptr<int64_t>() + world);

    at::Tensor sorted = x.index_select(0, at::div(order, k, "floor"));
    at::Tensor received = AllToAllRows(*ep_, sorted, route->send_rows, route->recv_rows);

    // Received rows come per source rank, each rank's grouped by local
    // expert: exactly the segments the expert backends take (no regrouping).
    DispatchedRows out;
    out.rows = received;
    const int64_t* rc = recv_matrix.data_ptr<int64_t>();
    for (int q = 0; q < world; ++q) {
      out.counts.insert(out.counts.end(), rc + q * max_local_, rc + q * max_local_ + num_local_);
    }
    out.route = std::move(route);
    return out;
  }

  at::Tensor Combine(const at::Tensor& y, const Route& r) override {
    ScopedPhase phase("combine");
    const auto& route = static_cast<const AllToAllRoute&>(r);
    at::Tensor back = AllToAllRows(*ep_, y, route.recv_rows, route.send_rows);
    return back.index_select(0, route.inverse_order);
  }

 private:
  std::shared_ptr<Communicator> ep_;
  router::RouterParallel remap_;
  int64_t max_local_ = 0;
  int64_t num_local_ = 0;
};

}  // namespace

std::unique_ptr<Dispatcher> CreateAllToAllDispatcher(std::shared_ptr<Communicator> ep,
                                                     const router::ExpertPlacement& placement) {
  return std::make_unique<AllToAllDispatcher>(std::move(ep), placement);
}

}  // namespace moefit::parallel
