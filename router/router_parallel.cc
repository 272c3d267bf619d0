// The RouterParallel remapping; see router_parallel.h.
#include "router/router_parallel.h"

#include <ATen/ATen.h>

#include <vector>

namespace moefit::router {

RouterParallel::RouterParallel(const ExpertPlacement& p, int rank)
    : ep_size_(p.ep_size()), max_local_(p.max_local()) {
  std::vector<int64_t> key(p.num_experts()), local(p.num_experts(), -1);
  for (int64_t e = 0; e < p.num_experts(); ++e) {
    key[e] = p.owner(e) * max_local_ + p.local_index(e);
    if (p.owner(e) == rank) local[e] = p.local_index(e);
  }
  owner_key_ = at::tensor(key, at::kLong);
  local_index_ = at::tensor(local, at::kLong);
}

OwnerOrder RouterParallel::SortByOwner(const at::Tensor& topk_idx) const {
  TORCH_CHECK(topk_idx.dim() == 2 && topk_idx.scalar_type() == at::kLong,
              "topk_idx must be [tokens, k] int64");
  at::Tensor key = owner_key_.index_select(0, topk_idx.reshape({-1}));
  OwnerOrder out;
  out.order = std::get<1>(at::sort(key, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  out.counts = at::bincount(key, /*weights=*/{}, ep_size_ * max_local_).view({ep_size_, max_local_});
  return out;
}

at::Tensor RouterParallel::LocalExpertIndex(const at::Tensor& topk_idx) const {
  return local_index_.index_select(0, topk_idx.reshape({-1})).view(topk_idx.sizes());
}

}  // namespace moefit::router
