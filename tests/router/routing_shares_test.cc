// Expert shares with bootstrap intervals: the matrix form against the
// sequence-by-sequence loop over the same draws, the share against its
// definition, the interval covering the truth about as often as its
// confidence says on synthetic sources, and bad inputs refused.
#include "router/routing_shares.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <random>

namespace moefit::router {
namespace {

// S sequences of varying length, each token choosing columns with the given
// probabilities (independently per column, as top-k choices of several
// layers are); counts [S, C], tokens [S].
std::pair<at::Tensor, at::Tensor> Synthetic(int64_t s, const std::vector<double>& p,
                                            uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int64_t> length(5, 60);
  at::Tensor counts = at::zeros({s, static_cast<int64_t>(p.size())}, at::kDouble);
  at::Tensor tokens = at::zeros({s}, at::kDouble);
  for (int64_t i = 0; i < s; ++i) {
    const int64_t n = length(gen);
    tokens[i] = static_cast<double>(n);
    for (size_t c = 0; c < p.size(); ++c) {
      counts[i][static_cast<int64_t>(c)] =
          static_cast<double>(std::binomial_distribution<int64_t>(n, p[c])(gen));
    }
  }
  return {counts, tokens};
}

TEST(BootstrapShares, MatrixFormEqualsTheLoop) {
  auto [counts, tokens] = Synthetic(37, {0.1, 0.5, 0.02, 0.9, 0.0}, 4);
  for (double confidence : {0.95, 0.5}) {
    const BootstrapOptions o{.num_resamples = 301, .confidence = confidence, .seed = 9};
    const ShareEstimates fast = BootstrapShares(counts, tokens, o);
    const ShareEstimates slow = BootstrapSharesLoop(counts, tokens, o);
    ASSERT_EQ(fast.share.size(), 5u);
    for (size_t c = 0; c < 5; ++c) {
      EXPECT_NEAR(fast.share[c], slow.share[c], 1e-12);
      EXPECT_NEAR(fast.low[c], slow.low[c], 1e-12) << c;
      EXPECT_NEAR(fast.high[c], slow.high[c], 1e-12) << c;
      EXPECT_LE(fast.low[c], fast.share[c] + 1e-12);
      EXPECT_GE(fast.high[c], fast.share[c] - 1e-12);
    }
    EXPECT_EQ(fast.low[4], 0.0);
    EXPECT_EQ(fast.high[4], 0.0);
  }
  // The share is sum of counts over sum of tokens.
  const ShareEstimates e = BootstrapShares(counts, tokens, {.num_resamples = 10});
  EXPECT_NEAR(e.share[1], counts.select(1, 1).sum().item<double>() / tokens.sum().item<double>(),
              1e-15);
}

// Over many synthetic sources drawn from known probabilities, the 90%
// interval holds the true probability about 90% of the time.
TEST(BootstrapShares, IntervalsCoverTheTruthAtTheirConfidence) {
  const std::vector<double> p = {0.3, 0.05};
  int covered[2] = {0, 0};
  constexpr int kSources = 200;
  for (int trial = 0; trial < kSources; ++trial) {
    auto [counts, tokens] = Synthetic(40, p, 100 + trial);
    const ShareEstimates e = BootstrapShares(
        counts, tokens,
        {.num_resamples = 400, .confidence = 0.9, .seed = static_cast<uint64_t>(trial)});
    for (int c = 0; c < 2; ++c) covered[c] += e.low[c] <= p[c] && p[c] <= e.high[c];
  }
  for (int c = 0; c < 2; ++c) {
    EXPECT_GE(covered[c], 0.82 * kSources) << "column " << c;
    EXPECT_LE(covered[c], 0.97 * kSources) << "column " << c;
  }
}

TEST(BootstrapShares, DrawsAreSeededAndInRange) {
  const auto a = BootstrapDraws(13, {.num_resamples = 5, .seed = 1});
  const auto b = BootstrapDraws(13, {.num_resamples = 5, .seed = 1});
  const auto c = BootstrapDraws(13, {.num_resamples = 5, .seed = 2});
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  for (const auto& d : a) {
    ASSERT_EQ(d.size(), 13u);
    for (int64_t s : d) EXPECT_TRUE(s >= 0 && s < 13);
  }
}

TEST(PerSequenceCounts, EqualsALoopOverTheRealTokens) {
  at::manual_seed(2);
  const int64_t b = 3, t = 7, k = 2, e = 5;
  at::Tensor idx = at::randint(0, e, {b * t, k}, at::kLong);
  const std::vector<int64_t> lengths = {7, 0, 4};
  at::Tensor fast = PerSequenceCounts(idx, lengths, e);
  ASSERT_EQ(fast.sizes(), (std::vector<int64_t>{b, e}));
  for (int64_t s = 0; s < b; ++s) {
    std::vector<double> want(e, 0.0);
    for (int64_t pos = 0; pos < lengths[s]; ++pos) {
      for (int64_t j = 0; j < k; ++j) want[idx[s * t + pos][j].item<int64_t>()] += 1;
    }
    for (int64_t x = 0; x < e; ++x) EXPECT_EQ(fast[s][x].item<double>(), want[x]) << s << " " << x;
  }
  EXPECT_EQ(fast.sum().item<double>(), (7 + 0 + 4) * k);
}

TEST(BootstrapShares, RefusesWhatHasNoShare) {
  EXPECT_THROW(BootstrapShares(at::zeros({2, 3}), at::zeros({2}), {}), c10::Error);
  EXPECT_THROW(BootstrapShares(at::zeros({2, 3}), at::ones({3}), {}), c10::Error);
  EXPECT_THROW(BootstrapShares(at::zeros({2, 3}), at::ones({2}), {.confidence = 1.0}), c10::Error);
}

}  // namespace
}  // namespace moefit::router
