// A training step's TensorBoard summary; see step_summaries.h.
#include "framework/step_summaries.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "framework/tensorboard_writer.h"

namespace moefit::framework {

tensorboard::Summary StepSummary(const StepStats& st, double tokens_per_s) {
  tensorboard::Summary s;
  AddScalar(&s, "train/loss", st.loss);
  AddScalar(&s, "train/aux_loss", st.aux_loss);
  AddScalar(&s, "train/lr", st.lr);
  AddScalar(&s, "train/grad_norm", st.grad_norm);
  AddScalar(&s, "train/tokens_per_s", tokens_per_s);
  AddScalar(&s, "time/step_s", st.seconds);
  AddScalar(&s, "time/expert_s", st.expert_seconds);
  AddScalar(&s, "time/comm_s", st.comm_seconds);
  AddScalar(&s, "time/optimizer_s", st.optimizer_seconds);
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  AddScalar(&s, "memory/host_rss_gib", st.host_rss_bytes / kGiB);
  AddScalar(&s, "memory/host_peak_gib", st.host_peak_bytes / kGiB);
  if (st.gpu_peak_bytes > 0) {
    AddScalar(&s, "memory/gpu_allocated_gib", st.gpu_allocated_bytes / kGiB);
    AddScalar(&s, "memory/gpu_peak_gib", st.gpu_peak_bytes / kGiB);
  }
  if (st.gpu_cache) AddScalar(&s, "gpu_cache/share", st.gpu_cache_share);
  if (st.moe_layers.empty()) return s;
  const bool telemetry = !st.moe_layers.front().decayed_load.empty();
  double worst = 0, cv_sum = 0, entropy_sum = 0;
  for (const LayerLoad& ll : st.moe_layers) {
    const std::string layer = absl::StrFormat("layer_%02d", ll.layer_idx);
    worst = std::max(worst, ll.max_over_mean);
    AddScalar(&s, "load_max_over_mean/" + layer, ll.max_over_mean);
    const std::vector<double> load(ll.tokens_per_expert.begin(), ll.tokens_per_expert.end());
    AddHistogram(&s, "expert_load/" + layer, load);
    if (!telemetry) continue;
    cv_sum += ll.cv;
    entropy_sum += ll.router_entropy;
    AddScalar(&s, "load_cv/" + layer, ll.cv);
    AddScalar(&s, "router_entropy/" + layer, ll.router_entropy);
    if (ll.balance_loss) AddScalar(&s, "balance_loss/" + layer, *ll.balance_loss);
    if (ll.correction_bias) {
      AddScalar(&s, "bias_std/" + layer, ll.correction_bias->std);
      AddScalar(&s, "bias_range/" + layer, ll.correction_bias->max - ll.correction_bias->min);
    }
    AddHistogram(&s, "expert_load_decayed/" + layer, ll.decayed_load);
  }
  AddScalar(&s, "routing/max_over_mean_max", worst);
  if (telemetry) {
    const double n = static_cast<double>(st.moe_layers.size());
    AddScalar(&s, "routing/cv_mean", cv_sum / n);
    AddScalar(&s, "routing/entropy_mean", entropy_sum / n);
  }
  return s;
}

ExpertMap StepExpertMap(const StepStats& st) {
  ExpertMap map;
  for (const LayerLoad& ll : st.moe_layers) {
    map.layer_idx.push_back(ll.layer_idx);
    map.num_experts = static_cast<int64_t>(ll.tokens_per_expert.size());
    for (double d : ll.decayed_load) map.load.push_back(static_cast<float>(d));
  }
  if (st.gpu_cache) {
    // The outlined experts are the ones the GPUs computed.
    map.hot.assign(map.load.size(), 0);
    for (size_t l = 0; l < st.moe_layers.size(); ++l) {
      for (int64_t x : st.moe_layers[l].gpu_experts) map.hot[l * map.num_experts + x] = 1;
    }
  }
  return map;
}

}  // namespace moefit::framework
