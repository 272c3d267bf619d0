// Stable sort of assignments by expert; see sort_by_expert.h.
#include "router/sort_by_expert.h"

#include <ATen/ATen.h>

namespace moefit::router {

ExpertOrder SortByExpert(const at::Tensor& topk_idx, int64_t num_experts) {
  TORCH_CHECK(topk_idx.dim() == 2 && topk_idx.scalar_type() == at::kLong,
              "topk_idx must be [tokens, k] int64");
  const int64_t k = topk_idx.size(1);
  at::Tensor flat = topk_idx.reshape({-1});
  ExpertOrder out;
  out.order = std::get<1>(at::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  out.token_idx = at::div(out.order, k, /*rounding_mode=*/"floor");
  at::Tensor counts = at::bincount(flat, /*weights=*/{}, num_experts).to(at::kCPU);
  TORCH_CHECK(counts.size(0) == num_experts, "expert id out of range [0, ", num_experts, ")");
  out.counts.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + num_experts);
  return out;
}

}  // namespace moefit::router
