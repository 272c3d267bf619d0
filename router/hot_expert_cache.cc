// The hot-expert cache policy; see hot_expert_cache.h.
#include "router/hot_expert_cache.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "router/routing_stats.h"

namespace moefit::router {

HotExpertCachePolicy::HotExpertCachePolicy(int64_t num_candidates,
                                           const HotExpertCacheOptions& options)
    : options_(options), cached_(static_cast<size_t>(num_candidates), 0) {
  TORCH_CHECK(options.capacity >= 0 && options.every_steps >= 1 && options.margin >= 0 &&
                  options.noise_sigmas >= 0 && options.half_life_steps > 0,
              "hot-expert cache of capacity ", options.capacity, ", every ", options.every_steps,
              " steps, margin ", options.margin, " + ", options.noise_sigmas, " sigmas, half-life ",
              options.half_life_steps);
  one_plus_decay_ = 1 + DecayPerStep(options.half_life_steps);
}

bool HotExpertCachePolicy::Beats(double outsider, double insider) const {
  return outsider > (1 + options_.margin) * insider +
                        options_.noise_sigmas * std::sqrt((outsider + insider) / one_plus_decay_);
}

HotExpertCachePolicy::Change HotExpertCachePolicy::Update(int64_t step,
                                                          std::span<const double> load) {
  TORCH_CHECK(load.size() == cached_.size(), "hot-expert cache of ", cached_.size(),
              " candidates given ", load.size(), " counters");
  Change change;
  if (step % options_.every_steps != 0 || options_.capacity == 0) return change;
  // Outsiders hottest first, insiders coldest first; ties by index.
  std::vector<int64_t> outside, inside;
  for (int64_t i = 0; i < num_candidates(); ++i) (cached_[i] ? inside : outside).push_back(i);
  std::stable_sort(outside.begin(), outside.end(),
                   [&](int64_t a, int64_t b) { return load[a] > load[b]; });
  std::stable_sort(inside.begin(), inside.end(),
                   [&](int64_t a, int64_t b) { return load[a] < load[b]; });
  size_t next = 0;  // the hottest outsider not yet taken
  // Free slots first.
  int64_t cached = static_cast<int64_t>(inside.size());
  while (cached < options_.capacity && next < outside.size() && load[outside[next]] > 0) {
    change.admit.push_back(outside[next++]);
    ++cached;
  }
  // Then trades, each outsider against the coldest insider left, while the
  // outsider beats it by the margin.
  for (size_t cold = 0; cold < inside.size() && next < outside.size(); ++cold, ++next) {
    if (!Beats(load[outside[next]], load[inside[cold]])) break;
    change.evict.push_back(inside[cold]);
    change.admit.push_back(outside[next]);
  }
  for (int64_t i : change.admit) cached_[i] = 1;
  for (int64_t i : change.evict) cached_[i] = 0;
  std::sort(change.admit.begin(), change.admit.end());
  std::sort(change.evict.begin(), change.evict.end());
  return change;
}

std::vector<int64_t> HotExpertCachePolicy::cached() const {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < num_candidates(); ++i) {
    if (cached_[i]) out.push_back(i);
  }
  return out;
}

}  // namespace moefit::router
