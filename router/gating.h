// Gating: router logits -> top-k expert ids and routing weights, and the
// Switch-style load-balancing loss.
//
// Numerics follow the Hugging Face reference (Qwen2-MoE, Qwen3-MoE, Mixtral):
// softmax in fp32 over all experts, top-k of the probabilities, optional
// renormalization of the k kept weights. The balance loss is written in terms
// of per-expert sums (probability mass and assignment counts) plus a token
// count, so that sums from several layers — or, later, several ranks — can be
// added before the loss is formed and the result equals the reference loss over
// the concatenated tokens.
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

// Per-expert statistics of one or more routing decisions, the inputs of the
// balance loss. Sums add across layers and ranks.
struct BalanceStats {
  at::Tensor prob_sum;      // [E] fp32, sum over tokens of probs (differentiable)
  at::Tensor expert_count;  // [E] fp32, number of (token, slot) assignments per expert
  int64_t num_tokens = 0;
};

BalanceStats ComputeBalanceStats(const TopKRouting& routing, int64_t num_experts);

// num_experts * sum_e (expert_count_e / num_tokens) * (prob_sum_e / num_tokens):
// equal to HF `load_balancing_loss_func` over the same (concatenated) tokens.
// `expert_count` and `num_tokens` may be global while `prob_sum` is this rank's
// share: the sum over ranks of the result is then the global loss, with exact
// gradients for each rank's router.
at::Tensor LoadBalancingLoss(const at::Tensor& prob_sum, const at::Tensor& expert_count,
                             int64_t num_tokens, int64_t num_experts);

}  // namespace moefit::router
