// Routing telemetry; see routing_stats.h.
#include "router/routing_stats.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

namespace moefit::router {

LoadImbalance ComputeLoadImbalance(std::span<const double> load) {
  const Spread s = ComputeSpread(load);
  if (s.mean <= 0) return {};
  return {.max_over_mean = s.max / s.mean, .cv = s.std / s.mean};
}

Spread ComputeSpread(std::span<const double> values) {
  if (values.empty()) return {};
  Spread s;
  s.min = *std::min_element(values.begin(), values.end());
  s.max = *std::max_element(values.begin(), values.end());
  double sum = 0;
  for (double v : values) sum += v;
  s.mean = sum / static_cast<double>(values.size());
  // Two passes: the squared deviations, not E[x^2] - E[x]^2, which cancels.
  double sq = 0;
  for (double v : values) sq += (v - s.mean) * (v - s.mean);
  s.std = std::sqrt(sq / static_cast<double>(values.size()));
  return s;
}

double DecayPerStep(double half_life_steps) {
  TORCH_CHECK(half_life_steps > 0, "half-life of ", half_life_steps, " steps");
  return std::exp2(-1.0 / half_life_steps);
}

DecayedExpertLoad::DecayedExpertLoad(int64_t num_layers, int64_t num_experts,
                                     double half_life_steps)
    : num_layers_(num_layers),
      num_experts_(num_experts),
      half_life_steps_(half_life_steps),
      decay_(DecayPerStep(half_life_steps)),
      values_(static_cast<size_t>(num_layers * num_experts), 0.0) {}

void DecayedExpertLoad::Update(std::span<const double> counts) {
  TORCH_CHECK(counts.size() == values_.size(), "decayed load of ", values_.size(),
              " counters updated with ", counts.size(), " counts");
  for (size_t i = 0; i < values_.size(); ++i) values_[i] = values_[i] * decay_ + counts[i];
  ++num_steps_;
}

void DecayedExpertLoad::Restore(std::vector<double> values, int64_t num_steps) {
  TORCH_CHECK(values.size() == values_.size(), "decayed load of ", values_.size(),
              " counters restored from ", values.size());
  values_ = std::move(values);
  num_steps_ = num_steps;
}

std::vector<double> DecayedSumDirect(const std::vector<std::vector<double>>& history,
                                     double half_life_steps) {
  if (history.empty()) return {};
  std::vector<double> sum(history[0].size(), 0.0);
  const double t = static_cast<double>(history.size());
  for (size_t s = 0; s < history.size(); ++s) {
    const double weight = std::pow(2.0, -(t - 1 - static_cast<double>(s)) / half_life_steps);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += history[s][i] * weight;
  }
  return sum;
}

at::Tensor RouterEntropySum(const at::Tensor& scores) {
  TORCH_CHECK(scores.dim() == 2, "router scores must be [tokens, experts], got ", scores.sizes());
  at::Tensor p = scores.detach().to(at::kDouble);
  p = p / p.sum(-1, /*keepdim=*/true);
  return at::special_entr(p).sum();  // -p log p, 0 where p is 0
}

}  // namespace moefit::router
