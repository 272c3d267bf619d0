// RouterParallel-style remapping: the router picks global expert ids; expert
// parallelism needs, for each (token, slot) assignment, the rank that owns the
// expert and the expert's index on that rank (ExpertPlacement). Dispatchers
// build on these views of one remapping; the lookup tables are derived from
// the placement once, not per layer and step.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "router/expert_placement.h"

namespace moefit::router {

// Each token once per rank that owns at least one of its k experts (however
// many of them that rank owns): what travels in a deduplicated dispatch.
struct OwnerRoutes {
  // [U] int64: the token of each (token, owner) pair, grouped by owner rank
  // (rank 0's first), tokens ascending within a rank.
  at::Tensor tokens;
  // [U, k] int64: for each pair, the owner's local expert index of every slot
  // that owner computes, -1 for slots another rank owns.
  at::Tensor local_expert;
  // [ep_size]: pairs per owner rank (sums to U).
  std::vector<int64_t> per_owner;
  // [N, ep_size] int64: the pair of token t and owner q (its row in
  // `tokens`), -1 where q owns none of t's experts.
  at::Tensor pair_of;
};

class RouterParallel {
 public:
  // The remapping as seen from `rank` of the expert-parallel group.
  RouterParallel(const ExpertPlacement& placement, int rank);

  // topk_idx: [N, k] int64 global expert ids (CPU), each in [0, E).
  OwnerRoutes RouteByOwner(const at::Tensor& topk_idx) const;

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
