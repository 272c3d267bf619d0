// The step's balance loss and the correction-bias update against their
// definitions written out on small examples.
#include "router/balance.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "router/gating.h"

namespace moefit::router {
namespace {

TEST(StepLoadBalancingLoss, EqualsTheSwitchLossOverTheLayersConcatenatedTokens) {
  // Two MoE layers of the same three tokens, four experts, top-2: the loss
  // over both layers is the Switch loss of the six (token, layer) decisions.
  at::Tensor l0 =
      at::tensor({2.0f, 1.0f, 0.0f, -1.0f, 0.5f, 0.5f, 3.0f, 0.0f, -2.0f, 1.0f, 1.5f, 0.2f})
          .view({3, 4});
  at::Tensor l1 =
      at::tensor({0.1f, 0.2f, 0.3f, 0.4f, 4.0f, -1.0f, 0.0f, 1.0f, 1.0f, 1.0f, 2.0f, -3.0f})
          .view({3, 4});
  TopKRouting r0 = SoftmaxTopK(l0, {.num_experts_per_tok = 2});
  TopKRouting r1 = SoftmaxTopK(l1, {.num_experts_per_tok = 2});
  BalanceStats s0 = ComputeBalanceStats(r0, 4), s1 = ComputeBalanceStats(r1, 4);
  at::Tensor counts = at::stack({s0.expert_count, s1.expert_count}).to(at::kDouble);
  at::Tensor loss = StepLoadBalancingLoss(s0.prob_sum + s1.prob_sum, counts, 2);

  TopKRouting both = SoftmaxTopK(at::cat({l0, l1}), {.num_experts_per_tok = 2});
  BalanceStats all = ComputeBalanceStats(both, 4);
  EXPECT_EQ(all.num_tokens, 6);
  double expected = 0;
  for (int64_t e = 0; e < 4; ++e) {
    expected += all.expert_count[e].item<double>() / 6 * (all.prob_sum[e].item<double>() / 6);
  }
  EXPECT_NEAR(loss.item<double>(), 4 * expected, 1e-6);
}

TEST(UpdateCorrectionBiases, MovesEachBiasByTheRateTowardsItsLayersMeanLoad) {
  at::Tensor b0 = at::zeros({3}, at::kFloat);
  at::Tensor b2 = at::tensor({0.5f, 0.5f, 0.5f});
  // Layer 0: mean 2, loads 3 1 2 -> -rate, +rate, 0. Layer 1 has no bias.
  // Layer 2: loads 0 0 6 (mean 2) -> +rate, +rate, -rate.
  at::Tensor load =
      at::tensor({3.0, 1.0, 2.0, 9.0, 9.0, 9.0, 0.0, 0.0, 6.0}, at::kDouble).view({3, 3});
  UpdateCorrectionBiases({b0, at::Tensor(), b2}, load, 0.25);
  EXPECT_TRUE(at::equal(b0, at::tensor({-0.25f, 0.25f, 0.0f})));
  EXPECT_TRUE(at::equal(b2, at::tensor({0.75f, 0.75f, 0.25f})));
}

TEST(UpdateCorrectionBiases, LeavesAutogradOutAndBiaslessModelsAlone) {
  // An in-place update of a leaf that requires grad throws unless it runs
  // outside autograd.
  at::Tensor bias = at::zeros({2}, at::kFloat).requires_grad_(true);
  at::Tensor load = at::tensor({1.0, 3.0}, at::kDouble).view({1, 2});
  EXPECT_NO_THROW(UpdateCorrectionBiases({bias}, load, 1.0));
  EXPECT_TRUE(at::equal(bias.detach(), at::tensor({1.0f, -1.0f})));
  UpdateCorrectionBiases({}, at::Tensor(), 1.0);  // no MoE layer has a bias
  EXPECT_THROW(UpdateCorrectionBiases({bias}, at::zeros({2, 2}), 1.0), c10::Error);
}

}  // namespace
}  // namespace moefit::router
