// The deduplicated all-to-all dispatcher (RouterParallel remapping); see
// dispatcher.h.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <numeric>

#include "parallel/differentiable_collectives.h"
#include "parallel/dispatcher.h"
#include "parallel/internal/dispatchers.h"
#include "parallel/internal/row_ops.h"
#include "parallel/progress.h"
#include "router/router_parallel.h"

namespace moefit::parallel {
namespace {

using internal::RowRelation;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t Sum(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

// The rows of `src` that a relation's members are (member m: src row
// slot[m] / f), in member order: what each row sends.
at::Tensor SourceRows(const RowRelation& rel) {
  return at::div(rel.slot, rel.members.size(1), "floor").contiguous();
}

at::Tensor RowsLike(const at::Tensor& x, int64_t rows) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = rows;
  return at::empty(shape, x.options());
}

void SaveRoute(AutogradContext* ctx, Communicator* comm, const RowRelation& rel,
               const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
  ctx->saved_data["comm"] = reinterpret_cast<int64_t>(comm);
  ctx->saved_data["members"] = rel.members;
  ctx->saved_data["slot"] = rel.slot;
  ctx->saved_data["send"] = send;
  ctx->saved_data["recv"] = recv;
  // Named by a watchdog report from the backward, which may run elsewhere.
  ctx->saved_data["layer"] = CurrentLayer();
  ctx->saved_data["phase"] = reinterpret_cast<int64_t>(CurrentPhase());
}

// The pieces SaveRoute kept, with the forward's progress restored for the
// backward's collective.
struct SavedRoute {
  explicit SavedRoute(AutogradContext* ctx)
      : comm(reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt())),
        rel{ctx->saved_data["members"].toTensor(), ctx->saved_data["slot"].toTensor()},
        send(ctx->saved_data["send"].toIntVector()),
        recv(ctx->saved_data["recv"].toIntVector()),
        layer(ctx->saved_data["layer"].toInt()),
        phase(reinterpret_cast<const char*>(ctx->saved_data["phase"].toInt()), /*backward=*/true) {}
  Communicator* comm;
  RowRelation rel;
  std::vector<int64_t> send, recv;
  ScopedLayer layer;
  ScopedPhase phase;
};

// Each token's row to every rank its relation's members go to: an
// all-to-all of the rows the members stand for, read where they lie in x
// (Communicator::AllToAllVGather: no gathered copy). Backward: the reverse
// all-to-all, then each token sums its rows' gradients.
class SendRowsFn : public torch::autograd::Function<SendRowsFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* comm,
                            const at::Tensor& members, const at::Tensor& slot,
                            const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
    const RowRelation rel{members, slot};
    SaveRoute(ctx, comm, rel, send, recv);
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    at::Tensor out = RowsLike(x, Sum(recv));
    comm->AllToAllVGather(x.contiguous(), SourceRows(rel), send, out, recv)->WaitOrThrow();
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const SavedRoute r(ctx);
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    const at::Tensor grad = grads[0].contiguous();
    at::Tensor back = RowsLike(grad, Sum(r.send));
    r.comm->AllToAllV(grad, r.recv, back, r.send)->WaitOrThrow();
    return {internal::Collect(back, r.rel).to(dtype),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

// The partial outputs back to their tokens' ranks, each token summing its
// rows there. Backward: each token's gradient goes to every rank it came
// from, read where it lies (AllToAllVGather).
class ReturnRowsFn : public torch::autograd::Function<ReturnRowsFn> {
 public:
  // send/recv: this rank's rows out (the partials) and back (the relation's
  // members).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& partial, Communicator* comm,
                            const at::Tensor& members, const at::Tensor& slot,
                            const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
    const RowRelation rel{members, slot};
    SaveRoute(ctx, comm, rel, send, recv);
    ctx->saved_data["dtype"] = static_cast<int64_t>(partial.scalar_type());
    const at::Tensor in = partial.contiguous();
    at::Tensor back = RowsLike(in, Sum(recv));
    comm->AllToAllV(in, send, back, recv)->WaitOrThrow();
    return internal::Collect(back, rel);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const SavedRoute r(ctx);
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    const at::Tensor grad = grads[0].to(dtype).contiguous();
    at::Tensor out = RowsLike(grad, Sum(r.send));
    r.comm->AllToAllVGather(grad, SourceRows(r.rel), r.recv, out, r.send)->WaitOrThrow();
    return {out, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

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
    at::Tensor rows = SendRowsFn::apply(x, ep_.get(), route->home.members, route->home.slot,
                                        route->send_pairs, route->recv_pairs);
    route->weights = SendRowsFn::apply(topk_weight, ep_.get(), route->home.members,
                                       route->home.slot, route->send_pairs, route->recv_pairs);
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
    out.row_index = at::div(route->remote.slot, k, "floor");
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
    return ReturnRowsFn::apply(partial, ep_.get(), route.home.members, route.home.slot,
                               route.recv_pairs, route.send_pairs);
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
