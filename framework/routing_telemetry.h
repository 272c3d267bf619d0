// The trainer's routing telemetry: from what each MoE layer's router saw in a
// step (MoeLayerRouting) to the per-layer figures of StepStats -- tokens per
// expert, their decayed counters, load imbalance, router entropy, the
// layer's balance loss and the spread of its correction biases.
//
// Global, and cheap: every rank packs its per-layer sums of a micro-batch
// into one [layers, columns] tensor (PackRoutingSums) that the trainer sums
// over the data-parallel ranks in the one all-reduce the expert counts
// already take for the balance loss and the bias update; the figures are
// then computed alike on every rank from the same global sums (router/
// routing_stats.h), so N processes report exactly what one process reports
// over the same global batch.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "framework/model.h"
#include "router/routing_stats.h"

namespace moefit::framework {

struct LayerLoad;
struct StepStats;

// One MoE layer's row of the packed sums: its expert counts, then (with
// telemetry) its probability sums, entropy sum and sequence-wise balance
// loss sum.
struct RoutingColumns {
  int64_t num_experts = 0;
  bool telemetry = false;
  int64_t width() const { return telemetry ? 2 * num_experts + 2 : num_experts; }
  int64_t prob_sum() const { return num_experts; }
  int64_t entropy_sum() const { return 2 * num_experts; }
  int64_t seq_balance_sum() const { return 2 * num_experts + 1; }
};

// [layers, columns.width()] float64 on the CPU: this rank's sums of one
// forward pass, to be summed over ranks. Columns the router did not compute
// (no entropy without ModelRuntime::routing_telemetry, no sequence-wise loss
// without aux_loss_alpha) are 0.
at::Tensor PackRoutingSums(const std::vector<MoeLayerRouting>& layers,
                           const RoutingColumns& columns);

// Accumulates the global sums of a step's micro-batches and turns them into
// StepStats::moe_layers; keeps the decayed counters from step to step.
class RoutingTelemetry {
 public:
  struct Options {
    bool enabled = true;  // false: tokens per expert and max/mean only
    double half_life_steps = 50;
  };
  explicit RoutingTelemetry(const Options& options) : options_(options) {}

  RoutingColumns columns(const ModelOptions& model) const {
    return {.num_experts = model.num_experts, .telemetry = options_.enabled};
  }

  // Starts a step.
  void BeginStep();
  // One micro-batch's global sums (PackRoutingSums summed over the ranks) of
  // `layers` (what the forward returned), over `num_sequences` sequences
  // (all ranks').
  void AddMicroBatch(const at::Tensor& global_sums, const std::vector<MoeLayerRouting>& layers,
                     const ModelOptions& model, int64_t num_sequences);
  // The step's assignment counts so far, [layers, E] float64 (undefined
  // before the first micro-batch): what the correction biases move by.
  at::Tensor step_counts() const;
  // The MoE layers' correction biases (undefined where a layer has none).
  const std::vector<at::Tensor>& correction_biases() const { return correction_biases_; }
  // Ends the step after the optimizer and the bias update: updates the
  // decayed counters and fills stats->moe_layers.
  void EndStep(StepStats* stats);

  // The decayed counters (empty before the first step with MoE layers).
  const router::DecayedExpertLoad& decayed() const { return decayed_; }

 private:
  Options options_;
  RoutingColumns columns_;
  int64_t num_experts_per_tok_ = 1;
  int64_t num_micro_ = 0;
  at::Tensor sums_;                   // [layers, width] over the step's micro-batches
  std::vector<double> balance_loss_;  // per layer, summed over micro-batches
  bool has_balance_loss_ = false;
  std::vector<int64_t> layer_idx_;
  std::vector<at::Tensor> correction_biases_;
  router::DecayedExpertLoad decayed_;
};

}  // namespace moefit::framework
