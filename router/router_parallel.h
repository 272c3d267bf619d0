// RouterParallel-style remapping: the router picks global expert ids; expert
// parallelism needs, for each (token, slot) assignment, the rank that owns the
// expert and the expert's index on that rank (ExpertPlacement). Dispatchers
// build on these two views of one remapping; the lookup tables are derived
// from the placement once, not per layer and step.
#pragma once

#include <ATen/core/Tensor.h>

#include "router/expert_placement.h"

namespace moefit::router {

struct OwnerOrder {
  // [N*k] int64: sorted position -> flat assignment (token * k + slot),
  // stably sorted by (owner rank, local expert index).
  at::Tensor order;
  // [ep_size, max_local] int64: assignments per (owner rank, local expert).
  at::Tensor counts;
};

class RouterParallel {
 public:
  // The remapping as seen from `rank` of the expert-parallel group.
  RouterParallel(const ExpertPlacement& placement, int rank);

  // topk_idx: [N, k] int64 global expert ids (CPU).
  OwnerOrder SortByOwner(const at::Tensor& topk_idx) const;

  // [N, k] int64: each assignment's local expert index on this rank, -1 where
  // another rank owns the expert.
  at::Tensor LocalExpertIndex(const at::Tensor& topk_idx) const;

 private:
  int ep_size_ = 1;
  int64_t max_local_ = 0;
  at::Tensor owner_key_;    // [E]: owner * max_local + local index (the sort key)
  at::Tensor local_index_;  // [E]: local index on this rank, -1 elsewhere
};

}  // namespace moefit::router
