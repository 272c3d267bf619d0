// Token dispatch and combine: moving each (token, slot) assignment's row to the
// rank that owns its expert, and the expert outputs back.
//
// Two dispatchers behind one interface (`parallel.dispatcher`):
//   alltoall   (default) the RouterParallel scheme (router/router_parallel.h): global expert
//              ids are remapped to (owner rank, local expert), assignments are
//              sorted by that pair, per-(peer, local expert) counts are
//              exchanged first, then the rows go with one all-to-all-v, and
//              come back with the reverse one.
//   allgather  the HF transformers EP scheme: every rank gathers all tokens,
//              computes its own experts' assignments (the rest masked out), and
//              the partial outputs are summed over ranks.
// Both are autograd-aware (their backward sends gradients the opposite way)
// and leave routing weights to the caller, who applies them on the token's
// home rank so that the router's gradient stays local. Over a group of one
// rank both reduce to a local sort by expert.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
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
  at::Tensor rows;  // [R, H]: rows for this rank's experts, in segments
  // Rows per segment; segment s holds rows of local expert s % num_local (the
  // layout experts/expert_backend.h takes): num_local segments (grouped by
  // expert) or, for alltoall, num_local per source rank.
  std::vector<int64_t> counts;
  std::unique_ptr<Route> route;
};

class Dispatcher {
 public:
  virtual ~Dispatcher() = default;
  virtual std::string_view name() const = 0;

  // x: [N, H] this rank's tokens (host); topk_idx: [N, k] global expert ids
  // (host, int64). Collective over the expert-parallel group.
  virtual DispatchedRows Dispatch(const at::Tensor& x, const at::Tensor& topk_idx) = 0;

  // y: [R, H] expert outputs aligned with DispatchedRows::rows -> [N * k, H]
  // this rank's assignments in (token, slot) order. Collective.
  virtual at::Tensor Combine(const at::Tensor& y, const Route& route) = 0;
};

// Names of the dispatchers, in registration order.
std::vector<std::string> DispatcherNames();

// `ep` is the expert-parallel group; its size must equal placement.ep_size().
absl::StatusOr<std::unique_ptr<Dispatcher>> CreateDispatcher(
    std::string_view name, std::shared_ptr<Communicator> ep, const router::ExpertPlacement& placement);

}  // namespace moefit::parallel
