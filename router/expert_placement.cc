// Contiguous expert placement; see expert_placement.h.
#include "router/expert_placement.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moefit::router {

absl::StatusOr<ExpertPlacement> ExpertPlacement::Contiguous(int64_t num_experts, int ep_size) {
  if (ep_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("parallel.ep_size = ", ep_size, " must be >= 1"));
  }
  if (ep_size > num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.ep_size = ", ep_size, " exceeds model.num_experts = ", num_experts,
                     ": some ranks would own no expert"));
  }
  ExpertPlacement p;
  p.first_.push_back(0);
  const int64_t base = num_experts / ep_size, extra = num_experts % ep_size;
  for (int r = 0; r < ep_size; ++r) {
    const int64_t n = base + (r < extra ? 1 : 0);
    for (int64_t e = 0; e < n; ++e) p.owner_.push_back(r);
    p.first_.push_back(p.first_.back() + n);
  }
  return p;
}

int64_t ExpertPlacement::max_local() const {
  int64_t m = 0;
  for (int r = 0; r < ep_size(); ++r) m = std::max(m, num_local(r));
  return m;
}

}  // namespace moefit::router
