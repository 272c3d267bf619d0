// The training loop: global batches, gradient accumulation, AdamW (fused,
// framework/adamw.h) with a warm-up + cosine schedule, global-norm clipping,
// progress and metrics.
//
// Data parallelism: the global batch of a step is split over the
// data-parallel ranks (micro-batch m of rank r is positions
// [m*W*B + r*B, m*W*B + (r+1)*B) of the global batch, so micro-batch m of W
// ranks is micro-batch m of one rank with W times the batch size); dense
// gradients are summed over the data-parallel group, expert gradients over the
// ranks holding replicas of the same experts.
//
// Each micro-batch reaches the model with its position and segment ids, so
// that packed samples (framework/data.h) neither see nor predict each other.
//
// The loss of a step is the sum of per-token cross entropies over the whole
// global batch divided by the number of trained tokens in it (not a mean of
// per-micro-batch means), so that any split of the batch into micro-batches —
// or ranks — gives the same loss and the same gradients. The balance loss of
// softmax routers is HF's: over all MoE layers' routing decisions of a
// micro-batch, scaled by router_aux_loss_coef and averaged over micro-batches.
// Sigmoid routers use DeepSeek-V3's sequence-wise loss (aux_loss_alpha) and
// aux-loss-free balancing: after each optimizer step every layer's
// e_score_correction_bias moves by bias_update_rate towards balance, from the
// per-expert counts of the whole global batch.
//
// Routing telemetry (framework/routing_telemetry.h) rides on the same sums:
// each micro-batch's per-layer counts, probability sums, router entropies and
// balance-loss sums are summed over ranks in one all-reduce, and every rank
// derives each MoE layer's figures of the step (LayerLoad) from them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "framework/data.h"
#include "framework/model.h"
#include "parallel/process_groups.h"
#include "router/routing_stats.h"

namespace moefit::framework {

// The options of a run, filled from its config by launch::ResolveConfig:
// proto/config.proto states each default and range, once. Zero here means
// "not filled".
struct OptimizerOptions {
  double lr = 0;
  double weight_decay = 0;
  double beta1 = 0;
  double beta2 = 0;
  double eps = 0;
  double max_grad_norm = 0;  // 0 = no clipping
  // bfloat16 expert copies of float32 masters rounded stochastically (see
  // AdamWHyper); to nearest otherwise.
  bool stochastic_rounding = false;
};

struct ScheduleOptions {
  int64_t warmup_steps = 0;
  double min_lr_ratio = 0;
};

struct TrainOptions {
  int64_t steps = 0;
  int64_t micro_batch_size = 0;
  int64_t grad_accum_steps = 0;
  uint64_t seed = 0;
  OptimizerOptions optimizer;
  ScheduleOptions schedule;
  // Aux-loss-free balancing: per-step move of each correction bias (routers
  // with e_score_correction_bias only); 0 = frozen.
  double bias_update_rate = 0;
  // Compute dtype of the dense layers (autocast of the dense device when
  // bfloat16; the parameters and their gradients stay float32) and whether
  // float32 GPU matrix products may use TF32 (a GPU only). The command line
  // takes bfloat16 only with the dense layers on a GPU; on the CPU it is here
  // for tests of the mixed-precision path.
  at::ScalarType dense_autocast = at::kFloat;
  bool allow_tf32 = false;
  // Dense gradients summed bucket by bucket during the last micro-batch's
  // backward (parallel::OverlappedGradSync), or all after it
  // (parallel::AllReduceSum): the same sums.
  bool overlap_grad_sync = false;
  int64_t grad_bucket_bytes = 0;
  std::string metrics_file;  // JSON Lines; empty = none (written by rank 0)
  int64_t log_every = 0;
  // Routing telemetry (framework/routing_telemetry.h) in StepStats::moe_layers:
  // decayed counters with this half-life in steps, imbalance, router entropy,
  // balance losses, correction-bias spread. Off: tokens per expert and
  // max/mean only.
  bool routing_telemetry = false;
  double routing_half_life_steps = 0;
  // TensorBoard event files (framework/tensorboard_writer.h, tags in
  // framework/step_summaries.h) written by rank 0 into this directory; empty =
  // none.
  std::string tensorboard_dir;
  // The expert map (framework/expert_map.h) every this many steps and after
  // the last step, drawn from the decayed counters (routing_telemetry); 0 =
  // none. PNG files go to expert_map_dir (expert-map-step-NNNNNNNN.png, and
  // expert-map.png at the end; empty = no files) and, with tensorboard_dir,
  // into TensorBoard as the image "expert_map".
  int64_t expert_map_every_steps = 0;
  std::string expert_map_dir;
  // Hot experts on the GPU (the model's ModelRuntime::expert_cache_device):
  // each process computes up to this many of its experts there, the hottest
  // by the decayed counters, chosen with hysteresis by
  // router::HotExpertCachePolicy and reconsidered every
  // gpu_cache_every_steps steps. 0 = none.
  int64_t gpu_cache_experts = 0;
  int64_t gpu_cache_every_steps = 0;
};

// Learning rate of optimizer step `step` (0-based): linear warm-up to lr over
// warmup_steps, then cosine decay to lr * min_lr_ratio at the last step.
double ScheduledLr(const TrainOptions& options, int64_t step);

// One MoE layer's routing in a step, over the global batch (the same on every
// rank). The fields after max_over_mean are filled with
// TrainOptions::routing_telemetry only.
struct LayerLoad {
  int64_t layer_idx = 0;
  std::vector<int64_t> tokens_per_expert;  // assignments (token, slot) per expert
  double max_over_mean = 0;
  double cv = 0;  // coefficient of variation of tokens_per_expert
  // Decayed access counter of each expert after this step
  // (router::DecayedExpertLoad).
  std::vector<double> decayed_load;
  double router_entropy = 0;  // mean over the step's tokens, nats
  // The layer's own balance loss (unscaled, mean over micro-batches): the
  // Switch loss of its softmax router, or the sequence-wise loss of a sigmoid
  // router with aux_loss_alpha > 0; none otherwise.
  std::optional<double> balance_loss;
  // Spread of the layer's e_score_correction_bias after the step's update
  // (routers that have one).
  std::optional<router::Spread> correction_bias;
  // With the hot-expert cache: the experts (global ids) computed on a
  // process's GPU during this step, by any process.
  std::vector<int64_t> gpu_experts;
};

struct StepStats {
  int64_t step = 0;  // 1-based, as printed
  double loss = 0;   // cross entropy per trained token
  // Balance loss (unscaled), mean over micro-batches: the Switch loss of
  // softmax routers, or the sequence-wise loss of sigmoid routers (when
  // aux_loss_alpha > 0).
  double aux_loss = 0;
  double lr = 0;
  double grad_norm = 0;       // before clipping
  int64_t tokens = 0;         // tokens processed in the step
  double seconds = 0;         // wall clock of the step
  double expert_seconds = 0;  // of which in the expert backends
  double comm_seconds = 0;    // of which blocked in collectives
  // Of which zeroing the gradients, summing them over ranks, their norm and
  // clipping, and the optimizer step (its collectives' waits are also in
  // comm_seconds).
  double optimizer_seconds = 0;
  int64_t pcie_bytes = 0;  // activations copied between GPU and host, both ways
  // This process's resident host memory at the end of the step, and its peak
  // so far (VmRSS, VmHWM); the dense GPU's memory held by LibTorch's caching
  // allocator now and at its peak (0 without a GPU).
  int64_t host_rss_bytes = 0;
  int64_t host_peak_bytes = 0;
  int64_t gpu_allocated_bytes = 0;
  int64_t gpu_peak_bytes = 0;
  // With the hot-expert cache (gpu_cache): of the rows (token, expert) all
  // processes' experts computed in the step, the share computed on their
  // GPUs.
  bool gpu_cache = false;
  double gpu_cache_share = 0;
  std::vector<LayerLoad> moe_layers;
};

class FusedAdamW;

// Runs on every rank after each step with the number of steps done (the
// step's 1-based index); returns whether to stop now (every rank must return
// the same), or an error that ends the run. The training checkpointer
// (framework/training_checkpoint.h) saves from here.
using StepEndHook = std::function<absl::StatusOr<bool>(int64_t steps_done)>;

class Trainer {
 public:
  // `groups` null: this process alone. Otherwise the model must have been
  // built with groups->expert_parallel as its expert group.
  Trainer(MoeModel& model, const TokenDataset& data, const TrainOptions& options,
          const parallel::ProcessGroups* groups = nullptr);
  ~Trainer();

  // One optimizer step over global batch `step` (0-based).
  StepStats Step(int64_t step);

  // All steps; rank 0 prints a progress line per step to `log` and appends
  // metrics. `after_step`, if set, runs on every rank after each step.
  // Returns the per-step stats (the same on every rank).
  // Steps run from first_step() (0 unless a checkpoint was restored) to
  // options.steps; `at_step_end`, if set, runs after `after_step` and may end
  // the run early.
  absl::StatusOr<std::vector<StepStats>> Run(
      std::ostream& log, const std::function<void(const StepStats&)>& after_step = {},
      const StepEndHook& at_step_end = {});

  // What a training checkpoint saves and restores.
  MoeModel& model();
  FusedAdamW& optimizer();
  const parallel::ProcessGroups& groups() const;
  const TrainOptions& options() const;
  // The step Run starts at: the number of steps already taken.
  int64_t first_step() const;
  void set_first_step(int64_t step);
  // Sequences per optimizer step (over all ranks).
  int64_t global_batch() const;
  // Sequences in the data set (what the sampler permutes).
  int64_t num_sequences() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moefit::framework
