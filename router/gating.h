// Gating: router logits -> top-k expert ids and routing weights. The balance
// losses and the correction-bias update that act on these decisions are in
// router/balance.h.
//
// Numerics follow the Hugging Face reference (Qwen2-MoE, Qwen3-MoE, Mixtral):
// softmax in fp32 over all experts, top-k of the probabilities, optional
// renormalization of the k kept weights.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace moefit::router {

struct SoftmaxTopKOptions {
  int64_t num_experts_per_tok = 1;
  // Divide the k kept probabilities by their sum (HF `norm_topk_prob`).
  bool norm_topk_prob = false;
};

struct TopKRouting {
  at::Tensor probs;        // [N, E] fp32 softmax over all experts (differentiable)
  at::Tensor topk_idx;     // [N, k] int64 global expert ids
  at::Tensor topk_weight;  // [N, k] fp32 routing weights (differentiable)
};

// logits: [N, E] in any floating dtype.
TopKRouting SoftmaxTopK(const at::Tensor& logits, const SoftmaxTopKOptions& options);

struct SigmoidTopKOptions {
  int64_t num_experts_per_tok = 1;
  // Experts are split into n_group equal groups of consecutive ids; a group's
  // score is the sum of its two best biased scores, and only the topk_group
  // best groups are eligible. n_group 1: plain top-k.
  int64_t n_group = 1;
  int64_t topk_group = 1;
  // Divide the k kept scores by their sum (+1e-20).
  bool norm_topk_prob = true;
  // Multiplies the weights after renormalization.
  double routed_scaling_factor = 1.0;
};

// DeepSeek-V3 routing (HF DeepseekV3TopkRouter, Glm4MoeTopkRouter): scores =
// sigmoid(logits) in fp32; the choice of experts uses scores +
// correction_bias (a [E] fp32 tensor, or undefined for none), the weights use
// the unbiased scores. `probs` of the result holds the sigmoid scores.
TopKRouting SigmoidGroupTopK(const at::Tensor& logits, const at::Tensor& correction_bias,
                             const SigmoidTopKOptions& options);

}  // namespace moefit::router
