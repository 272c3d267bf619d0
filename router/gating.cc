// Softmax top-k gating and the Switch balance loss; see gating.h.
#include "router/gating.h"

#include <ATen/ATen.h>

namespace moefit::router {

TopKRouting SoftmaxTopK(const at::Tensor& logits, const SoftmaxTopKOptions& options) {
  TORCH_CHECK(logits.dim() == 2, "router logits must be [tokens, experts], got ", logits.sizes());
  TORCH_CHECK(options.num_experts_per_tok >= 1 && options.num_experts_per_tok <= logits.size(1),
              "num_experts_per_tok = ", options.num_experts_per_tok, " with ", logits.size(1),
              " experts");
  TopKRouting out;
  out.probs = at::softmax(logits, /*dim=*/-1, at::kFloat);
  auto [values, indices] = at::topk(out.probs, options.num_experts_per_tok, /*dim=*/-1);
  if (options.norm_topk_prob) {
    values = values / values.sum(-1, /*keepdim=*/true);
  }
  out.topk_weight = values;
  out.topk_idx = indices;
  return out;
}

BalanceStats ComputeBalanceStats(const TopKRouting& routing, int64_t num_experts) {
  BalanceStats stats;
  stats.prob_sum = routing.probs.sum(0);
  stats.expert_count =
      at::bincount(routing.topk_idx.reshape({-1}), /*weights=*/{}, num_experts).to(at::kFloat);
  stats.num_tokens = routing.probs.size(0);
  return stats;
}

at::Tensor LoadBalancingLoss(const at::Tensor& prob_sum, const at::Tensor& expert_count,
                             int64_t num_tokens, int64_t num_experts) {
  TORCH_CHECK(num_tokens > 0, "balance loss over zero tokens");
  const double n = static_cast<double>(num_tokens);
  return (expert_count.to(prob_sum.device()) / n * (prob_sum / n)).sum() *
         static_cast<double>(num_experts);
}

}  // namespace moefit::router
