// Which of a process's routed experts to compute on its GPU: the policy of
// the hot-expert cache, apart from any model or device.
//
// A few experts take most tokens; computing those on the process's GPU
// instead of its CPU spends GPU memory (their weights, and when trained their
// masters, adapters and optimizer states) where it serves the most tokens.
// The policy sees one decayed access counter per candidate expert (router/
// routing_stats.h: a step's tokens weigh half one half-life later) and keeps
// a set of at most `capacity` of them:
//
//  * Empty slots are filled with the hottest candidates not cached (counter
//    > 0).
//  * Hysteresis: a cached expert is evicted only for a candidate whose
//    counter beats its own by a margin, the hottest outsider against the
//    coldest insider, then the next pair, until no pair qualifies:
//        c_out > (1 + margin) c_in + noise_sigmas sqrt((c_out + c_in) / (1 + d))
//    with d = 2^(-1/h) the counters' decay per step. The square root is the
//    standard deviation of the difference of two decayed counters of
//    Poisson arrivals (a counter of rate r has mean r / (1 - d) and variance
//    r / (1 - d^2), i.e. its mean / (1 + d)); `margin` covers what is not
//    Poisson (batches whose tokens share a topic) and swaps worth too little.
//    Experts whose loads differ by noise alone therefore do not trade places
//    back and forth; moving an expert costs a copy of its weights and
//    states across PCIe.
//  * The set is reconsidered at most every `every_steps` steps.
//
// How fast it follows a shift: when traffic moves from set A to set B, B's
// counters rise and A's decay with the half-life h. If A goes cold, B's
// counters pass A's a little before h steps; if A and B trade rates, they
// cross at exactly h steps (by symmetry). Any hysteresis waits for B to lead
// by its margin: for a hot/cold ratio r and a total margin m (the relative
// one plus the noise term over the counter), at
// h log2((r - 1)(2 + m) / (r - 1 - m)) steps when they trade (1.1 h for
// r = 10, m = 0.12), and at about h when A goes cold. A new hot set is thus
// followed within about one half-life, plus the wait for the next
// reconsideration.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace moefit::router {

struct HotExpertCacheOptions {
  int64_t capacity = 0;         // experts the GPU holds
  int64_t every_steps = 1;      // reconsider the set at most this often
  double half_life_steps = 50;  // of the counters the policy is given
  // Hysteresis: a fraction of the incumbent's counter, plus this many
  // standard deviations of the counters' Poisson noise.
  double margin = 0.05;
  double noise_sigmas = 4;
};

class HotExpertCachePolicy {
 public:
  // `num_candidates`: the experts that may be cached, numbered 0.. (the
  // caller's own numbering, e.g. MoE layer row x local expert).
  HotExpertCachePolicy(int64_t num_candidates, const HotExpertCacheOptions& options);

  // A change of the cached set.
  struct Change {
    std::vector<int64_t> admit;  // now cached (ascending)
    std::vector<int64_t> evict;  // no longer cached (ascending)
    bool empty() const { return admit.empty() && evict.empty(); }
  };

  // After step `step` (1-based) with the candidates' decayed counters
  // `load` (num_candidates values): the change to make now, empty unless it
  // is time to reconsider (step a multiple of every_steps) and the set moves.
  Change Update(int64_t step, std::span<const double> load);

  // The cached candidates, ascending.
  std::vector<int64_t> cached() const;
  bool is_cached(int64_t candidate) const { return cached_[candidate] != 0; }
  int64_t num_candidates() const { return static_cast<int64_t>(cached_.size()); }
  const HotExpertCacheOptions& options() const { return options_; }

 private:
  // Whether an outsider's counter beats an insider's by the margin.
  bool Beats(double outsider, double insider) const;

  HotExpertCacheOptions options_;
  double one_plus_decay_ = 2;
  std::vector<uint8_t> cached_;
};

}  // namespace moefit::router
