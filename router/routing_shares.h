// Each expert's share of a data source's tokens, with bootstrap confidence
// intervals: what turns "expert 17 of layer 3 specialises in code" from a
// guess into a measurement (moefit routing-report).
//
// Input: per-sequence counts -- counts[s][c] = tokens of sequence s that
// chose column c (a column is one (layer, expert)), tokens[s] = the
// sequence's token count. The share of column c is
//     sum_s counts[s][c] / sum_s tokens[s],
// the fraction of the source's tokens that chose it (an expert chosen by
// every token has share 1; the shares of a layer sum to num_experts_per_tok).
//
// Its uncertainty comes from which sequences happened to be drawn, so the
// bootstrap resamples whole sequences (tokens of one sequence are not
// independent draws): replicate b draws S sequences with replacement and
// recomputes every share; the interval is the percentile interval of the
// replicates (nearest rank: the floor((1-confidence)/2 x B)-th smallest and
// the ceil((1+confidence)/2 x B)-th). Replicates are a weight matrix W[b][s]
// (times sequence s was drawn) times the counts, one matrix product for all
// columns; BootstrapSharesLoop sums the drawn sequences one by one, from the
// same draws, for tests.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace moefit::router {

struct BootstrapOptions {
  int64_t num_resamples = 1000;
  double confidence = 0.95;
  uint64_t seed = 0;
};

struct ShareEstimates {
  std::vector<double> share;      // [C]
  std::vector<double> low, high;  // [C], the confidence interval
};

// counts: [S, C], tokens: [S] (any numeric dtype, CPU); S >= 1 with tokens.
ShareEstimates BootstrapShares(const at::Tensor& counts, const at::Tensor& tokens,
                               const BootstrapOptions& options);
ShareEstimates BootstrapSharesLoop(const at::Tensor& counts, const at::Tensor& tokens,
                                   const BootstrapOptions& options);

// Per-sequence expert counts of one layer's routing of a padded batch:
// topk_idx [B*T, k] (row-major over [B, T]) of B sequences padded to T
// tokens, lengths[b] <= T the real tokens of sequence b; returns [B, E]
// float64 counts of the real tokens' choices (padding left out).
at::Tensor PerSequenceCounts(const at::Tensor& topk_idx, const std::vector<int64_t>& lengths,
                             int64_t num_experts);

// The draws both use: replicate b's sequence indices, [B][S].
std::vector<std::vector<int64_t>> BootstrapDraws(int64_t num_sequences,
                                                 const BootstrapOptions& options);

}  // namespace moefit::router
