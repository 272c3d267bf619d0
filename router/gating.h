// Gating: router logits -> top-k expert ids and routing weights, and the
// balance losses: the Switch-style load-balancing loss of softmax routers and
// DeepSeek-V3's sequence-wise loss of sigmoid routers.
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

// DeepSeek-V3's sequence-wise balance loss, summed over sequences:
//   sum_s sum_i f_si * P_si,  f_si = E / (k T) * #{t in s : i in topk(t)},
//   P_si = 1/T sum_t scores_ti / sum_j scores_tj,
// for `scores` [S*T, E] (sigmoid scores, sequence-major) and `topk_idx` [S*T, k].
// Divided by the number of sequences and scaled by aux_loss_alpha it is the
// paper's loss; summing first lets ranks with different sequences add up.
at::Tensor SequenceBalanceLossSum(const at::Tensor& scores, const at::Tensor& topk_idx,
                                  int64_t num_sequences);

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
