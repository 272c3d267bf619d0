// Expert shares with bootstrap intervals; see routing_shares.h.
#include "router/routing_shares.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <random>

namespace moefit::router {
namespace {

void CheckInputs(const at::Tensor& counts, const at::Tensor& tokens,
                 const BootstrapOptions& options) {
  TORCH_CHECK(counts.dim() == 2 && tokens.dim() == 1 && counts.size(0) == tokens.size(0) &&
                  counts.size(0) >= 1,
              "shares of counts ", counts.sizes(), " over tokens ", tokens.sizes());
  TORCH_CHECK(tokens.sum().item<double>() > 0, "shares of sequences without tokens");
  TORCH_CHECK(options.num_resamples >= 1 && options.confidence > 0 && options.confidence < 1,
              "bootstrap of ", options.num_resamples, " resamples at confidence ",
              options.confidence);
}

// Rank positions (0-based) of the interval's ends among B sorted replicates.
std::pair<int64_t, int64_t> IntervalRanks(int64_t b, double confidence) {
  const double tail = (1 - confidence) / 2;
  const int64_t low = static_cast<int64_t>(std::floor(tail * static_cast<double>(b)));
  const int64_t high = static_cast<int64_t>(std::ceil((1 - tail) * static_cast<double>(b))) - 1;
  return {std::clamp<int64_t>(low, 0, b - 1), std::clamp<int64_t>(high, 0, b - 1)};
}

}  // namespace

at::Tensor PerSequenceCounts(const at::Tensor& topk_idx, const std::vector<int64_t>& lengths,
                             int64_t num_experts) {
  const int64_t b = static_cast<int64_t>(lengths.size());
  TORCH_CHECK(b >= 1 && topk_idx.dim() == 2 && topk_idx.size(0) % b == 0, "routing of ",
              topk_idx.sizes(), " for ", b, " sequences");
  const int64_t t = topk_idx.size(0) / b, k = topk_idx.size(1);
  at::Tensor valid = at::arange(t, at::kLong).unsqueeze(0) <
                     at::tensor(lengths, at::kLong).unsqueeze(1);  // [B, T]
  // Flat bins b * E + expert over the real tokens' k choices.
  at::Tensor bins = topk_idx.to(at::kCPU, at::kLong).view({b, t, k}) +
                    (at::arange(b, at::kLong) * num_experts).view({b, 1, 1});
  at::Tensor chosen = bins.masked_select(valid.unsqueeze(-1).expand({b, t, k}));
  return at::bincount(chosen, /*weights=*/{}, b * num_experts)
      .to(at::kDouble)
      .view({b, num_experts});
}

std::vector<std::vector<int64_t>> BootstrapDraws(int64_t num_sequences,
                                                 const BootstrapOptions& options) {
  std::mt19937_64 gen(options.seed);
  std::uniform_int_distribution<int64_t> pick(0, num_sequences - 1);
  std::vector<std::vector<int64_t>> draws(static_cast<size_t>(options.num_resamples));
  for (std::vector<int64_t>& d : draws) {
    d.resize(static_cast<size_t>(num_sequences));
    for (int64_t& s : d) s = pick(gen);
  }
  return draws;
}

ShareEstimates BootstrapShares(const at::Tensor& counts_in, const at::Tensor& tokens_in,
                               const BootstrapOptions& options) {
  CheckInputs(counts_in, tokens_in, options);
  const at::Tensor counts = counts_in.to(at::kDouble);
  const at::Tensor tokens = tokens_in.to(at::kDouble);
  const int64_t s = counts.size(0), b = options.num_resamples;
  ShareEstimates out;
  at::Tensor share = counts.sum(0) / tokens.sum();
  out.share.assign(share.data_ptr<double>(), share.data_ptr<double>() + share.numel());
  // W[b][s]: how often replicate b drew sequence s.
  at::Tensor w = at::zeros({b, s}, at::kDouble);
  double* wp = w.data_ptr<double>();
  const std::vector<std::vector<int64_t>> draws = BootstrapDraws(s, options);
  for (int64_t r = 0; r < b; ++r) {
    for (int64_t idx : draws[static_cast<size_t>(r)]) wp[r * s + idx] += 1;
  }
  // A replicate may draw only empty sequences: its shares are then 0.
  at::Tensor replicate_tokens = at::mv(w, tokens).clamp_min(1e-300).unsqueeze(1);
  at::Tensor replicates = std::get<0>(at::sort(at::mm(w, counts) / replicate_tokens, 0));
  const auto [low, high] = IntervalRanks(b, options.confidence);
  at::Tensor lo = replicates[low].contiguous(), hi = replicates[high].contiguous();
  out.low.assign(lo.data_ptr<double>(), lo.data_ptr<double>() + lo.numel());
  out.high.assign(hi.data_ptr<double>(), hi.data_ptr<double>() + hi.numel());
  return out;
}

ShareEstimates BootstrapSharesLoop(const at::Tensor& counts_in, const at::Tensor& tokens_in,
                                   const BootstrapOptions& options) {
  CheckInputs(counts_in, tokens_in, options);
  const at::Tensor counts = counts_in.to(at::kDouble).contiguous();
  const at::Tensor tokens = tokens_in.to(at::kDouble).contiguous();
  const int64_t s = counts.size(0), c = counts.size(1);
  const double* cp = counts.data_ptr<double>();
  const double* tp = tokens.data_ptr<double>();
  ShareEstimates out;
  double total = 0;
  for (int64_t i = 0; i < s; ++i) total += tp[i];
  out.share.assign(static_cast<size_t>(c), 0.0);
  for (int64_t col = 0; col < c; ++col) {
    double sum = 0;
    for (int64_t i = 0; i < s; ++i) sum += cp[i * c + col];
    out.share[col] = sum / total;
  }
  const std::vector<std::vector<int64_t>> draws = BootstrapDraws(s, options);
  std::vector<std::vector<double>> per_column(static_cast<size_t>(c));
  for (const std::vector<int64_t>& d : draws) {
    double replicate_tokens = 0;
    for (int64_t idx : d) replicate_tokens += tp[idx];
    for (int64_t col = 0; col < c; ++col) {
      double sum = 0;
      for (int64_t idx : d) sum += cp[idx * c + col];
      per_column[col].push_back(replicate_tokens > 0 ? sum / replicate_tokens : 0.0);
    }
  }
  const auto [low, high] = IntervalRanks(options.num_resamples, options.confidence);
  for (std::vector<double>& v : per_column) {
    std::sort(v.begin(), v.end());
    out.low.push_back(v[low]);
    out.high.push_back(v[high]);
  }
  return out;
}

}  // namespace moefit::router
