// Gating and balance loss against values computed by hand from the formulas.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "router/gating.h"

namespace moefit::router {
namespace {

TEST(SoftmaxTopK, PicksLargestAndRenormalizes) {
  at::Tensor logits = at::tensor({1.0f, 2.0f, 3.0f, 0.0f, 0.5f, 0.5f, -1.0f, 2.0f}).view({2, 4});
  TopKRouting r = SoftmaxTopK(logits, {.num_experts_per_tok = 2, .norm_topk_prob = false});
  const double z0 = std::exp(1.0) + std::exp(2.0) + std::exp(3.0) + std::exp(0.0);
  EXPECT_EQ(r.topk_idx[0][0].item<int64_t>(), 2);
  EXPECT_EQ(r.topk_idx[0][1].item<int64_t>(), 1);
  EXPECT_EQ(r.topk_idx[1][0].item<int64_t>(), 3);
  EXPECT_NEAR(r.topk_weight[0][0].item<float>(), std::exp(3.0) / z0, 1e-6);
  EXPECT_NEAR(r.topk_weight[0][1].item<float>(), std::exp(2.0) / z0, 1e-6);

  TopKRouting n = SoftmaxTopK(logits, {.num_experts_per_tok = 2, .norm_topk_prob = true});
  EXPECT_NEAR(n.topk_weight[0][0].item<float>(), std::exp(3.0) / (std::exp(3.0) + std::exp(2.0)),
              1e-6);
  EXPECT_NEAR(n.topk_weight[0][1].item<float>(), std::exp(2.0) / (std::exp(3.0) + std::exp(2.0)),
              1e-6);
  EXPECT_NEAR(n.topk_weight.sum(1)[1].item<float>(), 1.0f, 1e-6);
}

TEST(LoadBalancingLoss, MatchesHandComputedSwitchLoss) {
  // Two tokens, three experts, top-1. Token 0 -> expert 0, token 1 -> expert 2.
  at::Tensor logits = at::tensor({2.0f, 1.0f, 0.0f, 0.0f, 1.0f, 3.0f}).view({2, 3});
  TopKRouting r = SoftmaxTopK(logits, {.num_experts_per_tok = 1});
  BalanceStats s = ComputeBalanceStats(r, 3);
  const double z0 = std::exp(2.0) + std::exp(1.0) + 1.0;
  const double z1 = 1.0 + std::exp(1.0) + std::exp(3.0);
  const double p0[3] = {std::exp(2.0) / z0, std::exp(1.0) / z0, 1.0 / z0};
  const double p1[3] = {1.0 / z1, std::exp(1.0) / z1, std::exp(3.0) / z1};
  // f = fraction of assignments per expert = {1/2, 0, 1/2}; P = mean prob.
  const double expected = 3.0 * (0.5 * (p0[0] + p1[0]) / 2 + 0.5 * (p0[2] + p1[2]) / 2);
  at::Tensor loss = LoadBalancingLoss(s.prob_sum, s.expert_count, s.num_tokens, 3);
  EXPECT_NEAR(loss.item<float>(), expected, 1e-6);
  EXPECT_EQ(s.expert_count[1].item<float>(), 0.0f);
}

TEST(LoadBalancingLoss, UniformRoutingGivesOne) {
  // Equal logits and a perfectly even assignment: E * sum(1/E * 1/E * ... ) = k.
  at::Tensor logits = at::zeros({4, 4});
  TopKRouting r;
  r.probs = at::softmax(logits, -1);
  r.topk_idx = at::arange(4, at::kLong).view({4, 1});
  r.topk_weight = at::ones({4, 1});
  BalanceStats s = ComputeBalanceStats(r, 4);
  EXPECT_NEAR(LoadBalancingLoss(s.prob_sum, s.expert_count, 4, 4).item<float>(), 1.0f, 1e-6);
}

}  // namespace
}  // namespace moefit::router
