// Softmax and sigmoid top-k gating; see gating.h.
#include "router/gating.h"

#include <ATen/ATen.h>

#include <limits>

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

TopKRouting SigmoidGroupTopK(const at::Tensor& logits, const at::Tensor& correction_bias,
                             const SigmoidTopKOptions& options) {
  TORCH_CHECK(logits.dim() == 2, "router logits must be [tokens, experts], got ", logits.sizes());
  const int64_t num_experts = logits.size(1);
  const int64_t k = options.num_experts_per_tok;
  TORCH_CHECK(options.n_group >= 1 && num_experts % options.n_group == 0, num_experts,
              " experts do not split into n_group = ", options.n_group);
  TORCH_CHECK(options.topk_group >= 1 && options.topk_group <= options.n_group, "topk_group = ",
              options.topk_group, " with n_group = ", options.n_group);
  TORCH_CHECK(k >= 1 && k <= options.topk_group * (num_experts / options.n_group),
              "num_experts_per_tok = ", k, " exceeds the eligible experts");
  TopKRouting out;
  // fp32 at least (transformers scores in fp32; doubles stay doubles for gradient checks).
  out.probs = at::sigmoid(logits.to(at::promote_types(logits.scalar_type(), at::kFloat)));
  at::Tensor choice = out.probs.detach();
  if (correction_bias.defined()) choice = choice + correction_bias.to(choice.device());
  if (options.n_group > 1) {
    const int64_t group_size = num_experts / options.n_group;
    at::Tensor grouped = choice.view({-1, options.n_group, group_size});
    at::Tensor group_scores = std::get<0>(grouped.topk(2, /*dim=*/-1)).sum(-1);
    at::Tensor group_idx = std::get<1>(group_scores.topk(options.topk_group, /*dim=*/-1));
    at::Tensor group_mask = at::zeros_like(group_scores, at::kBool).scatter_(1, group_idx, true);
    at::Tensor expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape({-1, num_experts});
    choice = choice.masked_fill(expert_mask.logical_not(), -std::numeric_limits<float>::infinity());
  }
  out.topk_idx = std::get<1>(choice.topk(k, /*dim=*/-1));
  at::Tensor weights = out.probs.gather(1, out.topk_idx);
  if (options.norm_topk_prob) weights = weights / (weights.sum(-1, /*keepdim=*/true) + 1e-20);
  out.topk_weight = weights * options.routed_scaling_factor;
  return out;
}

}  // namespace moefit::router
