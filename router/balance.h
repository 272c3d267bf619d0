// Balancing the experts' load: the balance losses that the trainer adds to
// the language-model loss, and DeepSeek-V3's auxiliary-loss-free update of the
// routers' correction biases.
//
// Softmax routers (Qwen2/3-MoE, Mixtral) take the Switch-style loss of the
// Hugging Face reference; sigmoid routers (DeepSeek-V3, Kimi-K2, GLM-4.5) the
// sequence-wise loss and the bias update. The losses are written in terms of
// per-expert sums (probability mass and assignment counts) plus a token count,
// so that sums from several layers and several ranks can be added before the
// loss is formed, and the result equals the reference loss over the
// concatenated tokens.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "router/gating.h"

namespace moefit::router {

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

// The Switch loss of one micro-batch over all MoE layers, as Hugging Face's
// `load_balancing_loss_func` forms it from the layers' concatenated decisions:
// `prob_sum` [E] is this rank's probability mass summed over the layers,
// `layer_counts` [L, E] the global batch's assignments per layer and expert
// (summed over ranks). Every (token, layer) makes `num_experts_per_tok`
// assignments, which gives the token count. Summed over ranks, the result is
// the loss of the global micro-batch.
at::Tensor StepLoadBalancingLoss(const at::Tensor& prob_sum, const at::Tensor& layer_counts,
                                 int64_t num_experts_per_tok);

// Auxiliary-loss-free balancing (DeepSeek-V3): each layer's correction bias
// moves by `rate` towards balance, +rate for the experts below the layer's
// mean load and -rate above it (sign(mean - load)). `load` is [L, E], the
// step's global counts, which every rank holds alike, so the biases stay equal
// on all ranks. Row l of `load` goes to `correction_biases[l]`; undefined
// entries (layers without a bias) are skipped. Updates in place, outside
// autograd.
void UpdateCorrectionBiases(const std::vector<at::Tensor>& correction_biases,
                            const at::Tensor& load, double rate);

}  // namespace moefit::router
