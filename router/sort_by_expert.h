// Groups (token, slot) assignments by expert: the local half of dispatch.
//
// Expert kernels want the rows of one expert contiguous. Given the router's
// top-k ids, this computes a stable order of the N*k assignments sorted by
// expert, the token each sorted row comes from, and the rows per expert. The
// expert-parallel dispatcher builds on the same ordering with owner ranks first.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace moefit::router {

struct ExpertOrder {
  at::Tensor order;            // [N*k] int64: sorted position -> flat (token*k + slot) index
  at::Tensor token_idx;        // [N*k] int64: sorted position -> token index
  std::vector<int64_t> counts; // [E]: rows per expert in the sorted order
};

// topk_idx: [N, k] int64 expert ids in [0, num_experts). Works on any device;
// the result lives on topk_idx's device (counts on the host).
ExpertOrder SortByExpert(const at::Tensor& topk_idx, int64_t num_experts);

}  // namespace moefit::router
