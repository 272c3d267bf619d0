// A training step's metrics line and TensorBoard summary; see step_summaries.h.
#include "framework/step_summaries.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "framework/tensorboard_writer.h"

namespace moefit::framework {

proto::StepMetrics StepMetricsOf(const StepStats& st, const TrainOptions& o, double tokens_per_s,
                                 double eta_s) {
  proto::StepMetrics m;
  m.set_step(st.step);
  m.set_total_steps(o.steps);
  m.set_loss(st.loss);
  m.set_aux_loss(st.aux_loss);
  m.set_lr(st.lr);
  m.set_grad_norm(st.grad_norm);
  m.set_tokens_per_s(tokens_per_s);
  m.set_eta_s(eta_s);
  m.set_tokens(st.tokens);
  m.set_step_s(st.seconds);
  m.set_expert_s(st.expert_seconds);
  m.set_comm_s(st.comm_seconds);
  m.set_optimizer_s(st.optimizer_seconds);
  m.set_pcie_bytes(st.pcie_bytes);
  m.set_host_rss_bytes(st.host_rss_bytes);
  m.set_host_peak_bytes(st.host_peak_bytes);
  m.set_gpu_allocated_bytes(st.gpu_allocated_bytes);
  m.set_gpu_peak_bytes(st.gpu_peak_bytes);
  if (o.routing_telemetry) m.set_routing_half_life_steps(o.routing_half_life_steps);
  if (st.gpu_cache) m.set_gpu_cache_share(st.gpu_cache_share);
  for (const LayerLoad& ll : st.moe_layers) {
    proto::LayerLoad* pl = m.add_moe_layers();
    pl->set_layer(ll.layer_idx);
    for (int64_t c : ll.tokens_per_expert) pl->add_tokens_per_expert(c);
    pl->set_max_over_mean(ll.max_over_mean);
    pl->set_cv(ll.cv);
    for (double d : ll.decayed_load) pl->add_decayed_load(static_cast<float>(d));
    pl->set_router_entropy(ll.router_entropy);
    for (int64_t x : ll.gpu_experts) pl->add_gpu_experts(static_cast<int32_t>(x));
    if (ll.balance_loss) pl->set_balance_loss(*ll.balance_loss);
    if (ll.correction_bias) {
      proto::Spread* b = pl->mutable_correction_bias();
      b->set_min(ll.correction_bias->min);
      b->set_max(ll.correction_bias->max);
      b->set_mean(ll.correction_bias->mean);
      b->set_std(ll.correction_bias->std);
    }
  }
  return m;
}

absl::StatusOr<std::string> MetricsLine(const proto::StepMetrics& m) {
  std::string line;
  google::protobuf::util::JsonPrintOptions jo;
  jo.preserve_proto_field_names = true;
  jo.always_print_primitive_fields = true;
  if (!google::protobuf::util::MessageToJsonString(m, &line, jo).ok()) {
    return absl::InternalError("cannot serialize metrics");
  }
  return line;
}

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
