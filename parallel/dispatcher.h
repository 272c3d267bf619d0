// Token dispatch and combine: moving each token's row to the ranks that own
// its experts, and the routing-weighted expert outputs back.
//
// Two dispatchers behind one interface (`parallel.dispatcher`):
//   alltoall   (default) the RouterParallel scheme (router/router_parallel.h),
//              deduplicated as in DeepEP: a token travels once to each rank
//              that owns any of its k experts, with its routing weights and
//              those experts' local indices; the experts read each received
//              row once per local expert it visits, by index (no copy per
//              expert), and the receiver sums its experts' weighted outputs
//              into one row per token before sending it back. Counts are exchanged
//              first, then rows and weights are gathered and sent
//              (Communicator::AllToAllVGather) and indices with all-to-all-v.
//   allgather  the HF transformers EP scheme: every rank gathers all tokens,
//              computes its own experts' assignments (the rest masked out), and
//              the weighted partial outputs are summed over ranks.
// Both are autograd-aware: their backward sends gradients the opposite way,
// the routing weights' included (their gradient is computed where the expert
// output is and travels home with the rows'). Over a group of one rank both
// reduce to a local sort by expert; the alltoall dispatcher then copies no
// rows at all (its rows are the tokens' own, read where they lie).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "router/expert_placement.h"

namespace moefit::parallel {

// What Combine needs to send rows back; opaque to callers.
class Route {
 public:
  virtual ~Route() = default;
};

struct DispatchedRows {
  // [R, H]: the rows this rank received, one per token (and, with the
  // alltoall dispatcher, per rank that sent it), autograd-tracked.
  at::Tensor rows;
  // The expert computation's A rows, in segments: row a is
  // rows[row_index[a]] ([A] int64), and counts[s] rows make segment s, the
  // rows of local expert s (the layout experts/expert_backend.h takes):
  // num_local segments.
  at::Tensor row_index;
  std::vector<int64_t> counts;
  // [R, f] int64: the computation rows that read each received row, in the
  // order its gradient sums them (-1 where fewer than f).
  at::Tensor row_copies;
  std::unique_ptr<Route> route;
  // Rows this rank sent out (and gets back in Combine), itself included: with
  // deduplication fewer than its tokens x k.
  int64_t sent_rows = 0;
};

// The experts' part of a layer's routed path: given the rows a (chunk's)
// dispatch brought, their outputs [A, H], one per computation row.
using ExpertCompute = std::function<at::Tensor(const DispatchedRows&)>;

class Dispatcher {
 public:
  virtual ~Dispatcher() = default;
  virtual std::string_view name() const = 0;

  // x: [N, H] this rank's tokens (host); topk_idx: [N, k] global expert ids
  // (host, int64); topk_weight: [N, k] their routing weights (host, floating,
  // may require grad). Collective over the expert-parallel group.
  virtual DispatchedRows Dispatch(const at::Tensor& x, const at::Tensor& topk_idx,
                                  const at::Tensor& topk_weight) = 0;

  // y: [A, H] expert outputs, one per computation row (row_index) -> [N, H] each
  // token's sum over its k slots of weight x expert output, in y's dtype
  // promoted to at least float32. Collective.
  virtual at::Tensor Combine(const at::Tensor& y, const Route& route) = 0;

  // A layer's whole routed path, Combine(experts(Dispatch(x, ...))), over
  // `num_chunks` consecutive ranges of about N / num_chunks tokens, each
  // dispatched, computed and combined on its own; [N, H] as Combine's. With
  // more than one chunk a dispatcher that can pipelines them (alltoall): chunk
  // c + 1's rows travel while the experts compute chunk c, and chunk c's
  // outputs travel home while they compute chunk c + 1, in backward as well.
  // This default runs the chunks one after another. Each token's output is
  // computed from the same rows either way; chunking changes which rows share
  // an expert GEMM (and so the summation order of weight gradients).
  // num_chunks >= 1, the same on every rank. Collective.
  virtual at::Tensor Run(const at::Tensor& x, const at::Tensor& topk_idx,
                         const at::Tensor& topk_weight, int64_t num_chunks,
                         const ExpertCompute& experts);
};

// A layer's tokens in `num_chunks` consecutive ranges of about equal size
// (the later ones longer by one where it does not divide), as Run splits
// them: one split node per input, whose backward concatenates the chunks'
// gradients in one pass.
struct TokenChunks {
  std::vector<at::Tensor> x, topk_idx, topk_weight;
};
TokenChunks SplitTokens(const at::Tensor& x, const at::Tensor& topk_idx,
                        const at::Tensor& topk_weight, int64_t num_chunks);

// Names of the dispatchers, in registration order.
std::vector<std::string> DispatcherNames();

// `ep` is the expert-parallel group; its size must equal placement.ep_size().
absl::StatusOr<std::unique_ptr<Dispatcher>> CreateDispatcher(
    std::string_view name, std::shared_ptr<Communicator> ep, const router::ExpertPlacement& placement);

}  // namespace moefit::parallel
