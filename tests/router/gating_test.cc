// Gating and balance losses against values computed by hand from the
// formulas, and their gradients against finite differences in double.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "router/balance.h"
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

// logit(p): the logit whose sigmoid is p, so scores can be written down directly.
at::Tensor Logits(std::vector<double> scores) {
  at::Tensor p = at::tensor(scores, at::kDouble);
  return at::log(p / (1 - p)).view({1, -1});
}

TEST(SigmoidGroupTopK, BiasPicksExpertsButNotWeights) {
  // Scores sigmoid([0, 1, 2, -1]) = [.5, .731, .881, .269]; with the bias
  // [0, 0, -.5, .5] the choice scores are [.5, .731, .381, .769]: experts 3
  // and 1 win although expert 2 has the best score. Their weights are the
  // unbiased scores .269 and .731, which sum to exactly 1 (sigmoid(1) +
  // sigmoid(-1)), times the routed scaling factor.
  at::Tensor logits = at::tensor({0.0, 1.0, 2.0, -1.0}, at::kDouble).view({1, 4});
  at::Tensor bias = at::tensor({0.0, 0.0, -0.5, 0.5}, at::kFloat);
  TopKRouting r = SigmoidGroupTopK(logits, bias,
                                   {.num_experts_per_tok = 2, .norm_topk_prob = true,
                                    .routed_scaling_factor = 2.5});
  at::Tensor idx = std::get<0>(r.topk_idx.sort(-1));
  EXPECT_EQ(idx[0][0].item<int64_t>(), 1);
  EXPECT_EQ(idx[0][1].item<int64_t>(), 3);
  const double s1 = 1 / (1 + std::exp(-1.0)), s3 = 1 / (1 + std::exp(1.0));
  for (int64_t j = 0; j < 2; ++j) {
    const double expected = 2.5 * (r.topk_idx[0][j].item<int64_t>() == 1 ? s1 : s3) / (s1 + s3);
    EXPECT_NEAR(r.topk_weight[0][j].item<double>(), expected, 1e-12);
  }
  // Without the bias the two best scores win, and without renormalization
  // the weights are the scores themselves.
  TopKRouting plain =
      SigmoidGroupTopK(logits, {}, {.num_experts_per_tok = 2, .norm_topk_prob = false});
  idx = std::get<0>(plain.topk_idx.sort(-1));
  EXPECT_EQ(idx[0][0].item<int64_t>(), 1);
  EXPECT_EQ(idx[0][1].item<int64_t>(), 2);
  EXPECT_NEAR(plain.topk_weight.sum().item<double>(), s1 + 1 / (1 + std::exp(-2.0)), 1e-12);
}

TEST(SigmoidGroupTopK, OnlyTheBestGroupsAreEligible) {
  // Four groups of two: sums of each group's two best scores 1.0, 1.18, 1.1,
  // .95. Groups 1 and 2 win, so expert 0 (the best score, .9) is out, and the
  // top-2 are experts 2 and 3 (.6, .58), weights .6/1.18 and .58/1.18.
  at::Tensor logits = Logits({0.9, 0.1, 0.6, 0.58, 0.55, 0.55, 0.5, 0.45});
  TopKRouting r = SigmoidGroupTopK(
      logits, {},
      {.num_experts_per_tok = 2, .n_group = 4, .topk_group = 2, .norm_topk_prob = true});
  at::Tensor idx = std::get<0>(r.topk_idx.sort(-1));
  EXPECT_EQ(idx[0][0].item<int64_t>(), 2);
  EXPECT_EQ(idx[0][1].item<int64_t>(), 3);
  EXPECT_EQ(r.topk_idx[0][0].item<int64_t>(), 2);  // sorted, best first
  EXPECT_NEAR(r.topk_weight[0][0].item<double>(), 0.6 / 1.18, 1e-12);
  EXPECT_NEAR(r.topk_weight[0][1].item<double>(), 0.58 / 1.18, 1e-12);
  // One group eligible: the top-2 come from group 1 alone.
  r = SigmoidGroupTopK(logits, {},
                       {.num_experts_per_tok = 2, .n_group = 4, .topk_group = 1});
  idx = std::get<0>(r.topk_idx.sort(-1));
  EXPECT_EQ(idx[0][0].item<int64_t>(), 2);
  EXPECT_EQ(idx[0][1].item<int64_t>(), 3);
  // The bias takes part in the group scores: +.3 on expert 7 lifts group 3
  // (.5 + .75 = 1.25) above groups 1 and 2, and expert 7 (.75 biased) is
  // picked, with its unbiased score .45, beside expert 2 (.6).
  at::Tensor bias = at::zeros({8});
  bias[7] = 0.3;
  r = SigmoidGroupTopK(logits, bias,
                       {.num_experts_per_tok = 2, .n_group = 4, .topk_group = 2,
                        .norm_topk_prob = false});
  idx = std::get<0>(r.topk_idx.sort(-1));
  EXPECT_EQ(idx[0][0].item<int64_t>(), 2);
  EXPECT_EQ(idx[0][1].item<int64_t>(), 7);
  EXPECT_NEAR(r.topk_weight.sum().item<double>(), 0.6 + 0.45, 1e-12);
}

// Central differences against autograd, in double, for every input element.
void ExpectGradientMatches(const std::function<at::Tensor(const at::Tensor&)>& f, at::Tensor x) {
  x = x.detach().clone().requires_grad_(true);
  f(x).backward();
  at::Tensor analytic = x.grad().clone();
  at::Tensor flat = x.detach().view({-1});
  const double eps = 1e-6;
  for (int64_t i = 0; i < flat.numel(); ++i) {
    const double saved = flat[i].item<double>();
    flat[i] = saved + eps;
    const double up = f(x.detach()).item<double>();
    flat[i] = saved - eps;
    const double down = f(x.detach()).item<double>();
    flat[i] = saved;
    EXPECT_NEAR(analytic.view({-1})[i].item<double>(), (up - down) / (2 * eps), 1e-7)
        << "element " << i;
  }
}

TEST(SigmoidGroupTopK, GradientOfWeightsMatchesFiniteDifferences) {
  // Routing weights as a function of the logits (the selection is piecewise
  // constant; the logits are far from ties so differences do not cross one).
  at::Tensor logits = at::tensor({0.3, -1.2, 2.1, 0.8, -0.4, 1.5, -2.0, 0.1, 1.1, -0.7, 0.6, -1.6,
                                  0.9, 0.2, -0.9, 1.8},
                                 at::kDouble)
                          .view({2, 8});
  at::Tensor probe = at::tensor({0.7, -1.3, 0.4, 2.0, -0.6, 1.1}, at::kDouble).view({2, 3});
  at::Tensor bias = at::tensor({0.1, 0.0, -0.2, 0.05, 0.0, 0.3, 0.0, -0.1});
  ExpectGradientMatches(
      [&](const at::Tensor& l) {
        TopKRouting r = SigmoidGroupTopK(l, bias,
                                         {.num_experts_per_tok = 3, .n_group = 4, .topk_group = 2,
                                          .norm_topk_prob = true, .routed_scaling_factor = 2.5});
        return (r.topk_weight * probe).sum();
      },
      logits);
}

TEST(SequenceBalanceLoss, MatchesHandComputedExample) {
  // One sequence of two tokens, two experts, top-1, both tokens to expert 0.
  // Normalized scores [.8 .2] and [.5 .5]: P = [.65 .35]; f = [2 0]
  // (count * E / (k T)); loss = 2 * .65 = 1.3.
  at::Tensor scores = at::tensor({0.8, 0.2, 0.3, 0.3}, at::kDouble).view({2, 2});
  at::Tensor idx = at::tensor({0, 0}, at::kLong).view({2, 1});
  EXPECT_NEAR(SequenceBalanceLossSum(scores, idx, 1).item<double>(), 1.3, 1e-12);
  // As two sequences of one token: [2 0] . [.8 .2] + [2 0] . [.5 .5] = 2.6.
  EXPECT_NEAR(SequenceBalanceLossSum(scores, idx, 2).item<double>(), 2.6, 1e-12);
  // Perfect balance within a sequence gives 1: every f_i = 1, sum_i P_i = 1.
  at::Tensor even = at::full({4, 4}, 0.3, at::kDouble);
  at::Tensor idx2 = at::tensor({0, 1, 2, 3, 0, 1, 2, 3}, at::kLong).view({4, 2});
  EXPECT_NEAR(SequenceBalanceLossSum(even, idx2, 1).item<double>(), 1.0, 1e-12);
}

TEST(SequenceBalanceLoss, GradientMatchesFiniteDifferences) {
  at::Tensor logits = at::tensor({0.3, -1.2, 2.1, 0.8, -0.4, 1.5, -2.0, 0.1, 1.1, -0.7, 0.6, -1.6},
                                 at::kDouble)
                          .view({3, 4});
  at::Tensor idx = at::tensor({2, 3, 1, 3, 0, 2}, at::kLong).view({3, 2});
  ExpectGradientMatches(
      [&](const at::Tensor& l) { return SequenceBalanceLossSum(at::sigmoid(l), idx, 1); }, logits);
}

}  // namespace
}  // namespace moefit::router
