// Routing telemetry: the numbers that say what the routers of a MoE model do
// over training -- how unevenly each layer loads its experts, how sure the
// routers are, which experts have been hot lately.
//
// Everything here is a pure function of per-expert counts (or of router
// scores), with no model and no communication: the trainer sums the counts of
// the whole global batch over the ranks first (the all-reduce the
// correction-bias update already needs), so every rank computes the same
// figures from the same sums, and N processes give the numbers of one.
//
// "Hot lately" is a decayed access counter per (layer, expert), as in Strata
// and other tiered-memory placers: each step every counter is multiplied by
// 2^(-1/h) and the step's count is added, so a step's tokens weigh half as
// much h steps later (h: the half-life in steps). One multiply-add per counter
// and step, and no history kept; DecayedSumDirect is the sum it stands for,
// written out, for tests.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <span>
#include <vector>

namespace moefit::router {

// How unevenly one layer's experts are loaded: max / mean and the coefficient
// of variation (population standard deviation / mean). Both 0 for a layer
// that saw no token. A balanced layer has 1 and 0.
struct LoadImbalance {
  double max_over_mean = 0;
  double cv = 0;
};
LoadImbalance ComputeLoadImbalance(std::span<const double> load);

// min, max, mean and population standard deviation of `values` (all 0 when
// empty): the spread of a layer's correction biases.
struct Spread {
  double min = 0, max = 0, mean = 0, std = 0;
};
Spread ComputeSpread(std::span<const double> values);

// The factor a counter keeps per step for a half-life of `half_life_steps`
// (> 0): 2^(-1 / half_life_steps).
double DecayPerStep(double half_life_steps);

// Decayed per-expert access counters of every MoE layer, row-major
// [num_layers, num_experts].
class DecayedExpertLoad {
 public:
  DecayedExpertLoad() = default;
  DecayedExpertLoad(int64_t num_layers, int64_t num_experts, double half_life_steps);

  // One step: every counter decays, then adds its count of the step
  // (`counts` row-major [num_layers, num_experts]).
  void Update(std::span<const double> counts);

  int64_t num_layers() const { return num_layers_; }
  int64_t num_experts() const { return num_experts_; }
  double half_life_steps() const { return half_life_steps_; }
  // Steps counted so far.
  int64_t num_steps() const { return num_steps_; }
  // The counters of MoE layer `row` (0-based among the MoE layers).
  std::span<const double> layer(int64_t row) const {
    return std::span<const double>(values_).subspan(row * num_experts_, num_experts_);
  }
  const std::vector<double>& values() const { return values_; }
  // Replaces the counters (a resumed run continuing from saved ones); the
  // size must match.
  void Restore(std::vector<double> values, int64_t num_steps);

 private:
  int64_t num_layers_ = 0, num_experts_ = 0, num_steps_ = 0;
  double half_life_steps_ = 1, decay_ = 0.5;
  std::vector<double> values_;
};

// The slow twin of DecayedExpertLoad: for counts history[0..t) (each a vector
// of the same length), sum_s history[s] * 2^(-(t - 1 - s) / half_life_steps),
// each term computed with std::pow.
std::vector<double> DecayedSumDirect(const std::vector<std::vector<double>>& history,
                                     double half_life_steps);

// Sum over tokens of the entropy (nats) of each token's routing distribution:
// `scores` [N, E] are softmax probabilities or sigmoid scores, each row
// normalized to sum 1 first (DeepSeek-V3's routers score with sigmoids, whose
// row does not sum to 1). A float64 scalar on the scores' device, no
// gradient; divided by the token count it is the mean router entropy, between
// 0 (every token certain of one expert) and log(E) (uniform).
at::Tensor RouterEntropySum(const at::Tensor& scores);

}  // namespace moefit::router
