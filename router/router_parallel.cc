// The RouterParallel remapping; see router_parallel.h.
#include "router/router_parallel.h"

#include <ATen/ATen.h>

#include <algorithm>
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

OwnerRoutes RouterParallel::RouteByOwner(const at::Tensor& topk_idx) const {
  TORCH_CHECK(topk_idx.dim() == 2 && topk_idx.scalar_type() == at::kLong && topk_idx.is_cpu(),
              "topk_idx must be [tokens, k] int64 on the host");
  const at::Tensor idx = topk_idx.contiguous();
  const int64_t n = idx.size(0), k = idx.size(1), num_experts = owner_key_.numel();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t* key = owner_key_.data_ptr<int64_t>();
  for (int64_t i = 0; i < n * k; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < num_experts, "expert id ", ip[i], " outside [0, ",
                num_experts, ")");
  }
  // Two linear passes: count (token, owner) pairs, then place them. `last`
  // holds the token an owner last saw, so a token counts once per owner.
  OwnerRoutes out;
  out.per_owner.assign(ep_size_, 0);
  std::vector<int64_t> last(ep_size_, -1);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t q = key[ip[t * k + j]] / max_local_;
      if (last[q] != t) {
        last[q] = t;
        ++out.per_owner[q];
      }
    }
  }
  std::vector<int64_t> next(ep_size_, 0), row(ep_size_, 0);
  for (int q = 1; q < ep_size_; ++q) next[q] = next[q - 1] + out.per_owner[q - 1];
  const int64_t pairs = ep_size_ == 0 ? 0 : next.back() + out.per_owner.back();
  out.tokens = at::empty({pairs}, at::kLong);
  out.local_expert = at::full({pairs, k}, -1, at::kLong);
  out.pair_of = at::full({n, ep_size_}, -1, at::kLong);
  int64_t* tokens = out.tokens.data_ptr<int64_t>();
  int64_t* pair_of = out.pair_of.data_ptr<int64_t>();
  int64_t* local = out.local_expert.data_ptr<int64_t>();
  std::fill(last.begin(), last.end(), -1);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t owner_key = key[ip[t * k + j]];
      const int64_t q = owner_key / max_local_;
      if (last[q] != t) {
        last[q] = t;
        row[q] = next[q]++;
        tokens[row[q]] = t;
        pair_of[t * ep_size_ + q] = row[q];
      }
      local[row[q] * k + j] = owner_key % max_local_;
    }
  }
  return out;
}

at::Tensor RouterParallel::LocalExpertIndex(const at::Tensor& topk_idx) const {
  return local_index_.index_select(0, topk_idx.reshape({-1})).view(topk_idx.sizes());
}

}  // namespace moefit::router
