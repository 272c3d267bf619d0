// ExpertPlacement: which rank of the expert-parallel group owns which expert.
//
// Experts are identified by their global index everywhere on disk and in the
// router; a rank's local view (its experts, numbered 0..num_local-1) is
// derived from the placement. The default is contiguous blocks in rank order;
// when the expert count does not divide by the group size, the first
// (num_experts % ep_size) ranks own one expert more, so no rank is idle and
// loads differ by at most one expert.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace moefit::router {

class ExpertPlacement {
 public:
  // InvalidArgument when ep_size < 1 or ep_size > num_experts (a rank would own nothing).
  static absl::StatusOr<ExpertPlacement> Contiguous(int64_t num_experts, int ep_size);

  int64_t num_experts() const { return static_cast<int64_t>(owner_.size()); }
  int ep_size() const { return static_cast<int>(first_.size()) - 1; }
  int owner(int64_t expert_idx) const { return owner_[expert_idx]; }
  int64_t local_index(int64_t expert_idx) const { return expert_idx - first_[owner_[expert_idx]]; }
  int64_t num_local(int rank) const { return first_[rank + 1] - first_[rank]; }
  // Global index of `rank`'s first expert; its experts are [first, first + num_local).
  int64_t first_expert(int rank) const { return first_[rank]; }
  int64_t max_local() const;

 private:
  std::vector<int> owner_;      // [E]
  std::vector<int64_t> first_;  // [ep_size + 1]
};

}  // namespace moefit::router
