// The RouterParallel remapping; see router_parallel.h.
#include "router/router_parallel.h"

#include <ATen/ATen.h>

#include <vector>

namespace moefit::router {
namespace {

// Per global expert: owner * max_local + local index (the sort key).
at::Tensor OwnerKeys(const ExpertPlacement& p) {
  std::vector<int64_t> keys(p.num_experts());
  for (int64_t e = 0; e < p.num_experts(); ++e) keys[e] = p.owner(e) * p.max_local() + p.local_index(e);
  return at::tensor(keys, at::kLong);
}

}  // namespace

OwnerOrder SortByOwner(const at::Tensor& topk_idx, const ExpertPlacement& placement) {
  TORCH_CHECK(topk_idx.dim() == 2 && topk_idx.scalar_type() == at::kLong,
              "topk_idx must be [tokens, k] int64");
  const int64_t max_local = placement.max_local();
  at::Tensor key = OwnerKeys(placement).index_select(0, topk_idx.reshape({-1}));
  OwnerOrder out;
  out.order = std::get<1>(at::sort(key, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  out.counts = at::bincount(key, /*weights=*/{}, placement.ep_size() * max_local)
                   .view({placement.ep_size(), max_local});
  return out;
}

at::Tensor LocalExpertIndex(const at::Tensor& topk_idx, const ExpertPlacement& placement, int rank) {
  std::vector<int64_t> local(placement.num_experts(), -1);
  for (int64_t e = 0; e < placement.num_experts(); ++e) {
    if (placement.owner(e) == rank) local[e] = placement.local_index(e);
  }
  return at::tensor(local, at::kLong).index_select(0, topk_idx.reshape({-1})).view(topk_idx.sizes());
}

}  // namespace moefit::router
