// Balance losses and the correction-bias update; see balance.h.
#include "router/balance.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>

namespace moefit::router {

at::Tensor SequenceBalanceLossSum(const at::Tensor& scores, const at::Tensor& topk_idx,
                                  int64_t num_sequences) {
  TORCH_CHECK(num_sequences > 0 && scores.size(0) % num_sequences == 0, scores.size(0),
              " tokens do not split into ", num_sequences, " sequences");
  const int64_t num_experts = scores.size(1), k = topk_idx.size(1);
  const int64_t t = scores.size(0) / num_sequences;
  at::Tensor normalized = scores / scores.sum(-1, /*keepdim=*/true);
  at::Tensor p = normalized.view({num_sequences, t, num_experts}).mean(1);  // [S, E]
  at::Tensor counts =
      at::zeros({num_sequences, num_experts}, scores.options().requires_grad(false));
  counts.scatter_add_(1, topk_idx.view({num_sequences, t * k}).to(scores.device()),
                      at::ones({num_sequences, t * k}, counts.options()));
  at::Tensor f = counts * (static_cast<double>(num_experts) / static_cast<double>(k * t));
  return (f * p).sum();
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

at::Tensor StepLoadBalancingLoss(const at::Tensor& prob_sum, const at::Tensor& layer_counts,
                                 int64_t num_experts_per_tok) {
  TORCH_CHECK(layer_counts.dim() == 2 && layer_counts.size(1) == prob_sum.size(0), "layer counts ",
              layer_counts.sizes(), " against probability sums ", prob_sum.sizes());
  const int64_t num_experts = layer_counts.size(1);
  const int64_t tokens = std::llround(layer_counts.sum().item<double>()) / num_experts_per_tok;
  return LoadBalancingLoss(prob_sum, layer_counts.sum(0).to(at::kFloat), tokens, num_experts);
}

void UpdateCorrectionBiases(const std::vector<at::Tensor>& correction_biases,
                            const at::Tensor& load, double rate) {
  if (correction_biases.empty()) return;
  TORCH_CHECK(load.dim() == 2 && load.size(0) == static_cast<int64_t>(correction_biases.size()),
              "load ", load.sizes(), " for ", correction_biases.size(), " layers");
  at::NoGradGuard no_grad;
  for (size_t row = 0; row < correction_biases.size(); ++row) {
    at::Tensor bias = correction_biases[row];
    if (!bias.defined()) continue;
    at::Tensor c = load[static_cast<int64_t>(row)].to(at::kFloat);
    bias.add_(at::sign(c.mean() - c).to(bias.device()), rate);
  }
}

}  // namespace moefit::router
