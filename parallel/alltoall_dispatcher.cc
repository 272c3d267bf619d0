// The deduplicated all-to-all dispatcher (RouterParallel remapping); see
// dispatcher.h.
#include <ATen/ATen.h>

#include <numeric>

#include "absl/types/span.h"
#include "experts/kernels/row_ops.h"
#include "parallel/differentiable_collectives.h"
#include "parallel/dispatcher.h"
#include "parallel/internal/dispatchers.h"
#include "parallel/progress.h"
#include "router/router_parallel.h"

namespace moefit::parallel {
namespace {

using experts::kernels::RowRelation;

struct AllToAllRoute final : Route {
  std::vector<int64_t> send_pairs, recv_pairs;  // rows per peer
  // This rank's tokens -> the rows they sent (unset at one rank: the identity).
  RowRelation home;
  RowRelation remote;  // received rows -> their computation rows, one per local expert
  at::Tensor weights;  // [received, k] routing weights (autograd-tracked)
};

// A chunk's dispatch posted and not yet received.
struct PostedDispatch {
  std::unique_ptr<AllToAllRoute> route;
  RowsInFlight rows, weights;
  at::Tensor local;  // [received, k] the local expert of each slot, -1: elsewhere
  std::shared_ptr<Work> local_work;
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
    router::OwnerRoutes routes = remap_.RouteByOwner(topk_idx);
    if (ep_->size() == 1) return DispatchInPlace(x, topk_weight, routes);
    const std::vector<std::vector<int64_t>> recv = ExchangeCounts(absl::MakeConstSpan(&routes, 1));
    PostedDispatch posted = PostDispatch(x, topk_weight, routes, recv[0]);
    return FinishDispatch(posted);
  }

  at::Tensor Combine(const at::Tensor& y, const Route& r) override {
    ScopedPhase phase("combine");
    const auto& route = static_cast<const AllToAllRoute&>(r);
    // One rank: the weighted sums are already the tokens' rows, in order.
    if (ep_->size() == 1) return experts::kernels::Collect(y, route.remote, route.weights);
    return FinishRows(PostCombine(y, route));
  }

  // The pipeline: with P(c) posting chunk c's dispatch, F(c) receiving it,
  // E(c) the experts, C(c) posting its combine and R(c) receiving that,
  //   P(0) P(1) F(0) E(0) C(0) P(2) F(1) E(1) C(1) R(0) ... F(n-1) E(n-1) C(n-1) R(n-2) R(n-1)
  // so that each chunk's exchange is in flight during a neighbour's experts.
  // Backward runs these nodes in reverse (differentiable_collectives.h), the
  // same pipeline mirrored. The counts of all chunks travel in one exchange.
  at::Tensor Run(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weight,
                 int64_t num_chunks, const ExpertCompute& experts) override {
    if (num_chunks <= 1 || ep_->size() == 1) {
      return Dispatcher::Run(x, topk_idx, topk_weight, num_chunks, experts);
    }
    const TokenChunks chunks = SplitTokens(x, topk_idx, topk_weight, num_chunks);
    std::vector<router::OwnerRoutes> routes;
    for (const at::Tensor& idx : chunks.topk_idx) routes.push_back(remap_.RouteByOwner(idx));
    std::vector<std::vector<int64_t>> recv;
    {
      ScopedPhase phase("dispatch");
      recv = ExchangeCounts(routes);
    }
    auto post = [&](int64_t c) {
      ScopedPhase phase("dispatch");
      return PostDispatch(chunks.x[c], chunks.topk_weight[c], routes[c], recv[c]);
    };
    std::vector<PostedDispatch> posted(num_chunks);
    std::vector<RowsInFlight> back(num_chunks);
    std::vector<at::Tensor> out(num_chunks);
    posted[0] = post(0);
    for (int64_t c = 0; c < num_chunks; ++c) {
      if (c + 1 < num_chunks) posted[c + 1] = post(c + 1);
      DispatchedRows d;
      {
        ScopedPhase phase("dispatch");
        d = FinishDispatch(posted[c]);
      }
      at::Tensor y = experts(d);
      ScopedPhase phase("combine");
      back[c] = PostCombine(y, static_cast<const AllToAllRoute&>(*d.route));
      if (c > 0) out[c - 1] = FinishRows(back[c - 1]);
    }
    {
      ScopedPhase phase("combine");
      out[num_chunks - 1] = FinishRows(back[num_chunks - 1]);
    }
    return at::cat(out);
  }

 private:
  // Rows per peer of each chunk's routes to every peer -> rows per peer each
  // chunk receives: one count exchange for them all.
  std::vector<std::vector<int64_t>> ExchangeCounts(absl::Span<const router::OwnerRoutes> routes) {
    const int world = ep_->size();
    const int64_t chunks = static_cast<int64_t>(routes.size());
    at::Tensor send_counts = at::empty({world, chunks}, at::kLong);
    int64_t* sp = send_counts.data_ptr<int64_t>();
    for (int q = 0; q < world; ++q) {
      for (int64_t c = 0; c < chunks; ++c) sp[q * chunks + c] = routes[c].per_owner[q];
    }
    at::Tensor recv_counts = at::empty_like(send_counts);
    ep_->AllToAllCounts(send_counts, recv_counts)->WaitOrThrow();
    const int64_t* rp = recv_counts.data_ptr<int64_t>();
    std::vector<std::vector<int64_t>> recv(chunks, std::vector<int64_t>(world));
    for (int q = 0; q < world; ++q) {
      for (int64_t c = 0; c < chunks; ++c) recv[c][q] = rp[q * chunks + c];
    }
    return recv;
  }

  // Posts the rows (gathered from x), their routing weights and
  // their experts' local indices.
  PostedDispatch PostDispatch(const at::Tensor& x, const at::Tensor& topk_weight,
                              const router::OwnerRoutes& routes,
                              const std::vector<int64_t>& recv_pairs) {
    PostedDispatch p;
    p.route = std::make_unique<AllToAllRoute>();
    AllToAllRoute& route = *p.route;
    route.send_pairs = routes.per_owner;
    route.recv_pairs = recv_pairs;
    // Token t's row to owner q is sent row pair_of[t, q].
    route.home = experts::kernels::MakeRowRelation(routes.pair_of, routes.tokens.numel());
    p.rows = StartSendRows(*ep_, x, route.home, route.send_pairs, route.recv_pairs);
    p.weights = StartSendRows(*ep_, topk_weight, route.home, route.send_pairs, route.recv_pairs);
    const int64_t received = std::accumulate(recv_pairs.begin(), recv_pairs.end(), int64_t{0});
    p.local = at::empty({received, routes.local_expert.size(1)}, at::kLong);
    p.local_work = ep_->AllToAllV(routes.local_expert, route.send_pairs, p.local, route.recv_pairs);
    return p;
  }

  DispatchedRows FinishDispatch(PostedDispatch& p) {
    at::Tensor rows = FinishRows(p.rows);
    p.route->weights = FinishRows(p.weights);
    p.local_work->WaitOrThrow();
    return ExpertRows(std::move(rows), p.local, std::move(p.route));
  }

  // With one rank every token's row goes to itself, as the pair of the same
  // index (RouteByOwner), so nothing is copied: the experts read x's rows
  // where they lie, and Combine's weighted sums are the output.
  DispatchedRows DispatchInPlace(const at::Tensor& x, const at::Tensor& topk_weight,
                                 const router::OwnerRoutes& routes) {
    auto route = std::make_unique<AllToAllRoute>();
    route->send_pairs = route->recv_pairs = routes.per_owner;
    route->weights = topk_weight;
    return ExpertRows(x.contiguous(), routes.local_expert, std::move(route));
  }

  // The received `rows` with `local`, the local expert of each of their slots
  // (-1: elsewhere), as the experts' input: a computation row per (received
  // row, local expert it visits), grouped by expert (a counting sort: arrival
  // order within an expert); the experts read the received row by index.
  DispatchedRows ExpertRows(at::Tensor rows, const at::Tensor& local,
                            std::unique_ptr<AllToAllRoute> route) {
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
    route->remote = experts::kernels::MakeRowRelation(position, copies);

    DispatchedRows out;
    out.rows = std::move(rows);
    out.row_index = experts::kernels::GroupOf(route->remote);
    out.row_copies = route->remote.members;
    out.counts = std::move(counts);
    out.sent_rows = std::accumulate(route->send_pairs.begin(), route->send_pairs.end(), int64_t{0});
    out.route = std::move(route);
    return out;
  }

  // Each received row's weighted sum over the experts it visited here, posted
  // back, to be summed over the ranks it went to when received.
  RowsInFlight PostCombine(const at::Tensor& y, const AllToAllRoute& route) {
    at::Tensor partial = experts::kernels::Collect(y, route.remote, route.weights);
    return StartReturnRows(*ep_, partial, route.home, route.recv_pairs, route.send_pairs);
  }

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
