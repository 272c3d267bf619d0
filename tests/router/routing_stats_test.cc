// Routing telemetry's figures against their definitions written out: the
// decayed counters against the direct weighted sum of the history (and the
// half-life itself), imbalance and spread against ATen's reductions in
// double, router entropy against a per-token loop.
#include "router/routing_stats.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace moefit::router {
namespace {

TEST(DecayedExpertLoad, EqualsTheDirectWeightedSum) {
  constexpr int64_t kLayers = 3, kExperts = 7;
  for (double half_life : {1.0, 2.5, 20.0, 1000.0}) {
    DecayedExpertLoad load(kLayers, kExperts, half_life);
    std::vector<std::vector<double>> history;
    std::mt19937 gen(17);
    std::uniform_int_distribution<int> count(0, 50);
    for (int step = 0; step < 120; ++step) {
      std::vector<double> c(kLayers * kExperts);
      for (double& x : c) x = count(gen);
      history.push_back(c);
      load.Update(c);
      const std::vector<double> direct = DecayedSumDirect(history, half_life);
      for (size_t i = 0; i < direct.size(); ++i) {
        ASSERT_NEAR(load.values()[i], direct[i], 1e-9 * (1 + direct[i]))
            << "half-life " << half_life << " step " << step << " counter " << i;
      }
    }
    EXPECT_EQ(load.num_steps(), 120);
    EXPECT_EQ(load.layer(2).size(), static_cast<size_t>(kExperts));
    EXPECT_EQ(load.layer(2)[0], load.values()[2 * kExperts]);
  }
}

TEST(DecayedExpertLoad, AStepWeighsHalfAfterOneHalfLife) {
  DecayedExpertLoad load(1, 2, 8);
  load.Update(std::vector<double>{100, 0});
  for (int i = 0; i < 8; ++i) load.Update(std::vector<double>{0, 0});
  EXPECT_NEAR(load.layer(0)[0], 50.0, 1e-9);
  for (int i = 0; i < 8; ++i) load.Update(std::vector<double>{0, 0});
  EXPECT_NEAR(load.layer(0)[0], 25.0, 1e-9);
  EXPECT_EQ(load.layer(0)[1], 0.0);
  // A steady count c per step converges to c / (1 - 2^(-1/h)).
  DecayedExpertLoad steady(1, 1, 8);
  for (int i = 0; i < 2000; ++i) steady.Update(std::vector<double>{3});
  EXPECT_NEAR(steady.layer(0)[0], 3 / (1 - DecayPerStep(8)), 1e-6);
}

TEST(DecayedExpertLoad, RestoreContinuesFromSavedCounters) {
  DecayedExpertLoad a(2, 2, 5), b(2, 2, 5);
  a.Update(std::vector<double>{1, 2, 3, 4});
  b.Restore(a.values(), a.num_steps());
  a.Update(std::vector<double>{4, 3, 2, 1});
  b.Update(std::vector<double>{4, 3, 2, 1});
  EXPECT_EQ(a.values(), b.values());
  EXPECT_EQ(b.num_steps(), 2);
  EXPECT_THROW(b.Restore({1, 2}, 1), c10::Error);
  EXPECT_THROW(b.Update(std::vector<double>{1}), c10::Error);
}

TEST(LoadImbalance, MatchesAtenReductions) {
  std::mt19937 gen(3);
  std::uniform_int_distribution<int> count(0, 1000);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<double> load(1 + trial * 7);
    for (double& x : load) x = count(gen);
    const LoadImbalance imb = ComputeLoadImbalance(load);
    at::Tensor t = at::tensor(load, at::kDouble);
    const double mean = t.mean().item<double>();
    EXPECT_NEAR(imb.max_over_mean, t.max().item<double>() / mean, 1e-12);
    EXPECT_NEAR(imb.cv, t.std(/*unbiased=*/false).item<double>() / mean, 1e-12);
  }
  const LoadImbalance balanced = ComputeLoadImbalance(std::vector<double>{5, 5, 5, 5});
  EXPECT_EQ(balanced.max_over_mean, 1.0);
  EXPECT_EQ(balanced.cv, 0.0);
  const LoadImbalance one_hot = ComputeLoadImbalance(std::vector<double>{0, 0, 8, 0});
  EXPECT_DOUBLE_EQ(one_hot.max_over_mean, 4.0);
  EXPECT_DOUBLE_EQ(one_hot.cv, std::sqrt(3.0));
  const LoadImbalance none = ComputeLoadImbalance(std::vector<double>{0, 0});
  EXPECT_EQ(none.max_over_mean, 0.0);
  EXPECT_EQ(none.cv, 0.0);
}

TEST(Spread, MatchesAtenReductions) {
  const std::vector<double> v = {-0.25, 0.5, 0.125, -1.0, 0.0};
  const Spread s = ComputeSpread(v);
  at::Tensor t = at::tensor(v, at::kDouble);
  EXPECT_EQ(s.min, -1.0);
  EXPECT_EQ(s.max, 0.5);
  EXPECT_NEAR(s.mean, t.mean().item<double>(), 1e-15);
  EXPECT_NEAR(s.std, t.std(/*unbiased=*/false).item<double>(), 1e-15);
  const Spread empty = ComputeSpread({});
  EXPECT_EQ(empty.max, 0.0);
}

TEST(RouterEntropySum, EqualsPerTokenLoop) {
  at::manual_seed(5);
  // Softmax probabilities, sigmoid scores (rows not summing to 1), and rows
  // with exact zeros.
  at::Tensor softmax = at::softmax(at::randn({9, 6}), -1);
  at::Tensor sigmoid = at::sigmoid(at::randn({9, 6}) * 3);
  at::Tensor with_zeros = softmax.clone();
  with_zeros.index_put_({0}, at::tensor({0.f, 0.f, 1.f, 0.f, 0.f, 0.f}));
  with_zeros.index_put_({1}, at::tensor({0.5f, 0.f, 0.5f, 0.f, 0.f, 0.f}));
  for (const at::Tensor& scores : {softmax, sigmoid, with_zeros}) {
    double loop = 0;
    for (int64_t t = 0; t < scores.size(0); ++t) {
      double z = 0;
      for (int64_t e = 0; e < scores.size(1); ++e) z += scores[t][e].item<double>();
      for (int64_t e = 0; e < scores.size(1); ++e) {
        const double p = scores[t][e].item<double>() / z;
        if (p > 0) loop -= p * std::log(p);
      }
    }
    at::Tensor sum = RouterEntropySum(scores);
    EXPECT_EQ(sum.scalar_type(), at::kDouble);
    EXPECT_NEAR(sum.item<double>(), loop, 1e-9);
  }
  // Uniform rows: log(E) each; one-hot rows: 0.
  EXPECT_NEAR(RouterEntropySum(at::full({4, 8}, 0.125)).item<double>(), 4 * std::log(8.0), 1e-12);
  EXPECT_NEAR(RouterEntropySum(at::eye(5)).item<double>(), 0.0, 1e-15);
  EXPECT_NEAR(RouterEntropySum(with_zeros).item<double>() -
                  RouterEntropySum(with_zeros.narrow(0, 2, 7)).item<double>(),
              std::log(2.0), 1e-9);
}

}  // namespace
}  // namespace moefit::router
