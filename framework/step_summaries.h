// What a training step shows: StepStats as a line of the metrics file
// (proto/metrics.proto), as one tensorboard::Summary
// (framework/tensorboard_writer.h), and as an expert map
// (framework/expert_map.h).
//
// Tags, grouped by their first component (TensorBoard's sections):
//   train/loss, train/aux_loss, train/lr, train/grad_norm, train/tokens_per_s
//   time/step_s, time/expert_s, time/comm_s, time/optimizer_s
//   memory/host_rss_gib, memory/host_peak_gib (and memory/gpu_allocated_gib,
//     memory/gpu_peak_gib with the dense layers on a GPU)
//   routing/max_over_mean_max (the worst layer), routing/cv_mean,
//     routing/entropy_mean (means over the MoE layers)
//   per MoE layer NN (its decoder layer index): load_max_over_mean/layer_NN,
//     load_cv/layer_NN, router_entropy/layer_NN, balance_loss/layer_NN (where
//     the router has one), bias_std/layer_NN and bias_range/layer_NN (max -
//     min; routers with correction biases)
//   histograms: expert_load/layer_NN (the step's tokens per expert, one value
//     per expert) and expert_load_decayed/layer_NN (the decayed counters)
//   gpu_cache/share with the hot-expert cache: the share of expert rows
//     computed on the GPUs
// The routing figures beyond load_max_over_mean and expert_load need
// TrainOptions::routing_telemetry.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "framework/expert_map.h"
#include "framework/trainer.h"
#include "proto/metrics.pb.h"
#include "proto/tensorboard_event.pb.h"

namespace moefit::framework {

// A step's metrics: its stats, the run's steps (options.steps) and half-life
// (with routing telemetry), its tokens per second and the time left.
proto::StepMetrics StepMetricsOf(const StepStats& stats, const TrainOptions& options,
                                 double tokens_per_s, double eta_s);

// The metrics file's line of `m`: JSON, every field under its proto name,
// zeros included.
absl::StatusOr<std::string> MetricsLine(const proto::StepMetrics& m);

tensorboard::Summary StepSummary(const StepStats& stats, double tokens_per_s);

// The expert map of a step: its MoE layers' decayed counters, as the metrics
// file stores them (float32), so that `moefit expert-map` draws the same
// pixels from that file, the experts computed on GPUs outlined when the
// hot-expert cache is on. Empty loads without routing telemetry.
ExpertMap StepExpertMap(const StepStats& stats);

}  // namespace moefit::framework
