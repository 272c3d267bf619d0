// The hot-expert cache policy: a traffic pattern in (tokens per expert per
// step, with Poisson noise, through the decayed counters of
// router/routing_stats.h), the sequence of cached sets out. It finds the hot
// set, does not flap on noise (and would without its margins: the check can
// fail), follows a shifted hot set within about one half-life (the bounds
// its header derives), reconsiders only every every_steps, never exceeds its
// capacity.
#include "router/hot_expert_cache.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "router/routing_stats.h"

namespace moefit::router {
namespace {

// Drives the policy with `rate(step, expert)` tokens on average per step.
class Traffic {
 public:
  Traffic(int64_t experts, double half_life, HotExpertCacheOptions options, uint32_t seed = 1)
      : load_(1, experts, half_life),
        policy_(experts, WithHalfLife(options, half_life)),
        gen_(seed) {}

  // Runs steps [first, last]; returns the number of steps whose update changed the set.
  template <typename Rate>
  int Run(int64_t first, int64_t last, Rate rate, std::vector<std::set<int64_t>>* sets = nullptr) {
    int changes = 0;
    for (int64_t step = first; step <= last; ++step) {
      std::vector<double> counts(static_cast<size_t>(load_.num_experts()));
      for (int64_t e = 0; e < load_.num_experts(); ++e) {
        const double mean = rate(step, e);
        counts[e] = mean > 0 ? std::poisson_distribution<int64_t>(mean)(gen_) : 0;
      }
      load_.Update(counts);
      const HotExpertCachePolicy::Change c = policy_.Update(step, load_.layer(0));
      EXPECT_LE(static_cast<int64_t>(policy_.cached().size()), policy_.options().capacity);
      if (!c.empty()) {
        ++changes;
        EXPECT_EQ(step % policy_.options().every_steps, 0) << "changed at step " << step;
      }
      if (sets != nullptr) {
        const std::vector<int64_t> now = policy_.cached();
        sets->emplace_back(now.begin(), now.end());
      }
    }
    return changes;
  }
  const HotExpertCachePolicy& policy() const { return policy_; }

 private:
  static HotExpertCacheOptions WithHalfLife(HotExpertCacheOptions o, double half_life) {
    o.half_life_steps = half_life;
    return o;
  }
  DecayedExpertLoad load_;
  HotExpertCachePolicy policy_;
  std::mt19937_64 gen_;
};

std::set<int64_t> Range(int64_t first, int64_t n) {
  std::set<int64_t> s;
  for (int64_t i = 0; i < n; ++i) s.insert(first + i);
  return s;
}

TEST(HotExpertCache, FindsTheHotSetAndKeepsIt) {
  // 64 experts, 8 of them (16..23) take 10x the others' tokens.
  Traffic t(64, 20, {.capacity = 8, .every_steps = 1});
  std::vector<std::set<int64_t>> sets;
  const int changes = t.Run(
      1, 1000, [](int64_t, int64_t e) { return e >= 16 && e < 24 ? 200.0 : 20.0; }, &sets);
  EXPECT_EQ(sets.back(), Range(16, 8));
  // The first step fills the cache from one noisy step; a few trades settle it.
  EXPECT_LE(changes, 4);
  for (size_t step = 20; step < sets.size(); ++step) ASSERT_EQ(sets[step], Range(16, 8)) << step;
}

// 16 experts of equal traffic for 8 slots: whichever 8 are cached, noise
// alone must not make them trade places.
TEST(HotExpertCache, DoesNotFlapOnNoise) {
  auto equal = [](int64_t, int64_t) { return 50.0; };
  Traffic with_margin(16, 10, {.capacity = 8, .every_steps = 1}, 7);
  const int changes = with_margin.Run(1, 2000, equal);
  EXPECT_EQ(changes, 1);  // the initial fill only
  // Either margin alone is not enough at this noise: a relative one of 10%
  // trades on the counters' early, noisy steps and on their extremes...
  Traffic relative_only(16, 10, {.capacity = 8, .every_steps = 1, .margin = 0.1, .noise_sigmas = 0},
                        7);
  EXPECT_GT(relative_only.Run(1, 2000, equal), 10);
  // ...and without hysteresis the set trades on noise, again and again.
  Traffic no_margin(16, 10, {.capacity = 8, .every_steps = 1, .margin = 0, .noise_sigmas = 0}, 7);
  EXPECT_GT(no_margin.Run(1, 2000, equal), 100);
}

// Experts 0..7 hot until step 500, then 32..39 instead; the others steady.
double Shifted(int64_t step, int64_t e, double old_after) {
  const bool old_set = e < 8, new_set = e >= 32 && e < 40;
  if (step <= 500) return old_set ? 200.0 : 20.0;
  if (new_set) return 200.0;
  return old_set ? old_after : 20.0;
}

TEST(HotExpertCache, FollowsASwapWithinItsBound) {
  constexpr double kHalfLife = 20;
  Traffic t(64, kHalfLife, {.capacity = 8, .every_steps = 1}, 3);
  std::vector<std::set<int64_t>> sets;
  t.Run(
      1, 700, [](int64_t s, int64_t e) { return Shifted(s, e, 20.0); }, &sets);
  EXPECT_EQ(sets[499], Range(0, 8));
  // Rates traded (ratio 10): the counters cross at one half-life and pass
  // by the margins at about 1.1 half-lives; allow noise up to 1.25.
  int64_t followed = -1;
  for (size_t i = 500; i < sets.size(); ++i) {
    if (sets[i] == Range(32, 8)) {
      followed = static_cast<int64_t>(i) + 1 - 500;
      break;
    }
  }
  ASSERT_GT(followed, 0) << "never followed";
  EXPECT_GE(followed, 0.9 * kHalfLife);
  EXPECT_LE(followed, 1.25 * kHalfLife);
  EXPECT_EQ(sets.back(), Range(32, 8));
}

TEST(HotExpertCache, FollowsASetThatWentColdWithinAboutOneHalfLife) {
  constexpr double kHalfLife = 20;
  for (int64_t every : {1, 4}) {
    Traffic t(64, kHalfLife, {.capacity = 8, .every_steps = every}, 5);
    std::vector<std::set<int64_t>> sets;
    t.Run(
        1, 700, [](int64_t s, int64_t e) { return Shifted(s, e, 0.0); }, &sets);
    EXPECT_EQ(sets[499], Range(0, 8));
    // Not before the counters cross (0.93 half-lives), and within 1.1
    // half-lives plus the wait for the next reconsideration.
    EXPECT_NE(sets[499 + 18], Range(32, 8)) << every;
    EXPECT_EQ(sets[499 + 22 + every], Range(32, 8)) << every;
  }
}

TEST(HotExpertCache, ReconsidersOnlyEveryNSteps) {
  Traffic t(32, 5, {.capacity = 4, .every_steps = 7}, 11);
  std::vector<std::set<int64_t>> sets;
  // Hot sets that move every 50 steps: the Run checks every change falls on a multiple of 7.
  const int changes = t.Run(
      1, 400, [](int64_t s, int64_t e) { return (e / 4) == (s / 50) % 8 ? 100.0 : 5.0; }, &sets);
  EXPECT_GE(changes, 7);
  for (size_t i = 0; i < 6; ++i) EXPECT_TRUE(sets[i].empty()) << "before step 7";
}

TEST(HotExpertCache, CapacityBeyondTheCandidatesTakesEveryUsedExpert) {
  HotExpertCachePolicy p(4, {.capacity = 10, .noise_sigmas = 0});
  HotExpertCachePolicy::Change c = p.Update(1, std::vector<double>{3, 0, 1, 2});
  EXPECT_EQ(c.admit, (std::vector<int64_t>{0, 2, 3}));  // expert 1 has no tokens yet
  EXPECT_TRUE(c.evict.empty());
  c = p.Update(2, std::vector<double>{3, 1, 1, 2});
  EXPECT_EQ(c.admit, (std::vector<int64_t>{1}));
  EXPECT_TRUE(p.Update(3, std::vector<double>{0, 0, 0, 0}).empty());  // never evicts for nothing
  HotExpertCachePolicy none(4, {.capacity = 0});
  EXPECT_TRUE(none.Update(1, std::vector<double>{1, 2, 3, 4}).empty());
  EXPECT_THROW(p.Update(4, std::vector<double>{1}), c10::Error);
}

}  // namespace
}  // namespace moefit::router
