// The training loop; see trainer.h.
#include "framework/trainer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "experts/expert_function.h"
#include "framework/adamw.h"
#include "framework/dense_autocast.h"
#include "framework/internal/host_transfer.h"
#include "framework/internal/process_memory.h"
#include "framework/output_dir.h"
#include "framework/routing_telemetry.h"
#include "framework/step_summaries.h"
#include "framework/tensorboard_writer.h"
#include "parallel/grad_sync.h"
#include "parallel/local_communicator.h"
#include "parallel/progress.h"
#include "proto/status_macros.h"
#include "router/balance.h"
#include "router/hot_expert_cache.h"

namespace moefit::framework {

double ScheduledLr(const TrainOptions& o, int64_t step) {
  const double lr = o.optimizer.lr;
  const int64_t warmup = o.schedule.warmup_steps;
  if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const int64_t decay_steps = std::max<int64_t>(1, o.steps - warmup - 1);
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / decay_steps);
  const double min_lr = lr * o.schedule.min_lr_ratio;
  return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

namespace {

parallel::ProcessGroups LocalGroups(const MoeModel& model) {
  parallel::ProcessGroups g;
  g.world = parallel::LocalCommunicator::Create("world");
  g.data_parallel = g.world;
  g.expert_parallel = model.runtime().expert_group;
  g.expert_data_parallel = parallel::LocalCommunicator::Create("edp");
  g.ep_size = 1;
  return g;
}

// One per-layer tensor of the routing summed over the MoE layers (in layer order).
at::Tensor SumOverLayers(const std::vector<MoeLayerRouting>& layers,
                         at::Tensor MoeLayerRouting::*field) {
  at::Tensor sum = layers[0].*field;
  for (size_t l = 1; l < layers.size(); ++l) sum = sum + layers[l].*field;
  return sum;
}

// Sums a small host tensor over `comm` (in place) and returns it.
at::Tensor SumOver(parallel::Communicator& comm, at::Tensor t) {
  comm.AllReduce(t, parallel::ReduceOp::kSum)->WaitOrThrow();
  return t;
}

// FNV-1a of a parameter's name: the same on every rank and every run.
uint64_t NameKey(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

}  // namespace

struct Trainer::Impl {
  MoeModel& model;
  const TokenDataset& data;
  TrainOptions options;
  parallel::ProcessGroups groups;
  BatchSampler sampler;
  std::unique_ptr<FusedAdamW> optimizer;
  std::vector<at::Tensor> dense_params, expert_params;
  // Sums the dense gradients during the last micro-batch's backward; null:
  // after backward (options.overlap_grad_sync off, or one data-parallel rank).
  std::unique_ptr<parallel::OverlappedGradSync> dense_sync;
  int64_t first_step = 0;
  RoutingTelemetry routing;
  // The hot-expert cache's choice of this process's experts (created at the
  // first step: one candidate per MoE layer and local expert).
  std::unique_ptr<router::HotExpertCachePolicy> cache_policy;

  Impl(MoeModel& m, const TokenDataset& d, const TrainOptions& o, const parallel::ProcessGroups* g)
      : model(m),
        data(d),
        options(o),
        groups(g != nullptr ? *g : LocalGroups(m)),
        sampler(d.num_sequences(), o.seed),
        routing({.enabled = o.routing_telemetry, .half_life_steps = o.routing_half_life_steps}) {
    // Dropout (LoRA's) draws from the default generator: the same seed, the
    // same masks, run after run; each rank its own stream.
    at::manual_seed(o.seed + static_cast<uint64_t>(groups.world->rank()));
    model.SetTraining(true);
    model.SetRoutingTelemetry(o.routing_telemetry);
    TORCH_CHECK(o.gpu_cache_experts == 0 ||
                    (model.runtime().expert_cache_device.has_value() && o.routing_telemetry),
                "the hot-expert cache needs a cache device in the model and routing telemetry");
    const c10::Device dense_device = model.runtime().dense_device;
    TORCH_CHECK(dense_device.is_cuda() || !o.allow_tf32, "TF32 needs the dense layers on a GPU");
    if (o.allow_tf32) at::globalContext().setAllowTF32CuBLAS(true);
    for (const Parameter& p : model.trainable_parameters()) {
      (p.expert ? expert_params : dense_params).push_back(p.tensor);
    }
    // Two groups: decayed weights, and norms/biases without weight decay.
    std::vector<at::Tensor> decay, no_decay;
    for (const Parameter& p : model.trainable_parameters()) {
      (p.weight_decay ? decay : no_decay).push_back(p.tensor);
    }
    optimizer = std::make_unique<FusedAdamW>(
        std::vector<FusedAdamW::Group>{{decay, o.optimizer.weight_decay}, {no_decay, 0.0}},
        AdamWHyper{o.optimizer.beta1, o.optimizer.beta2, o.optimizer.eps,
                   o.optimizer.stochastic_rounding, o.seed});
    // The optimizer writes the experts' bfloat16 compute copies as it
    // updates their float32 masters: no second pass after each step.
    for (const MoeModel::MasterCopy& mc : model.expert_master_copies()) {
      optimizer->AttachCopy(mc.master, mc.copy, NameKey(mc.name), mc.first_element);
    }
    if (o.overlap_grad_sync && dense_grad_group().size() > 1 && !dense_params.empty()) {
      absl::StatusOr<std::unique_ptr<parallel::OverlappedGradSync>> sync =
          parallel::OverlappedGradSync::Create(dense_grad_group(), dense_params,
                                               {.bucket_bytes = o.grad_bucket_bytes});
      TORCH_CHECK(sync.ok(), sync.status().ToString());
      dense_sync = *std::move(sync);
    }
  }

  // The step's hot-expert cache figures (which experts each process computed
  // on its GPU, the share of rows there: one all-reduce), then the next
  // cached set from the decayed counters, which every rank holds alike.
  void UpdateCache(int64_t steps_done, StepStats* stats) {
    const router::ExpertPlacement& placement = model.placement();
    const int ep_rank = groups.expert_parallel->rank();
    const int64_t first = placement.first_expert(ep_rank), local = placement.num_local(ep_rank);
    const int64_t layers = static_cast<int64_t>(stats->moe_layers.size());
    const int64_t e = model.options().num_experts;
    const MoeModel::ExpertRows rows = model.TakeExpertRows();
    at::Tensor summary = at::zeros({layers * e + 2}, at::kDouble);
    double* p = summary.data_ptr<double>();
    for (int64_t l = 0; l < layers; ++l) {
      for (int64_t j : model.cached_experts(stats->moe_layers[l].layer_idx))
        p[l * e + first + j] = 1;
    }
    p[layers * e] = static_cast<double>(rows.cached);
    p[layers * e + 1] = static_cast<double>(rows.total);
    SumOver(*groups.world, summary);
    stats->gpu_cache = true;
    stats->gpu_cache_share = p[layers * e + 1] > 0 ? p[layers * e] / p[layers * e + 1] : 0.0;
    for (int64_t l = 0; l < layers; ++l) {
      for (int64_t x = 0; x < e; ++x) {
        if (p[l * e + x] > 0) stats->moe_layers[l].gpu_experts.push_back(x);
      }
    }
    if (cache_policy == nullptr) {
      cache_policy = std::make_unique<router::HotExpertCachePolicy>(
          layers * local,
          router::HotExpertCacheOptions{.capacity = options.gpu_cache_experts,
                                        .every_steps = options.gpu_cache_every_steps,
                                        .half_life_steps = options.routing_half_life_steps});
    }
    std::vector<double> load(static_cast<size_t>(layers * local));
    for (int64_t l = 0; l < layers; ++l) {
      for (int64_t j = 0; j < local; ++j)
        load[l * local + j] = stats->moe_layers[l].decayed_load[first + j];
    }
    if (cache_policy->Update(steps_done, load).empty()) return;
    std::vector<std::vector<int64_t>> per_layer(static_cast<size_t>(layers));
    for (int64_t i : cache_policy->cached()) per_layer[i / local].push_back(i % local);
    for (int64_t l = 0; l < layers; ++l) {
      model.SetCachedExperts(stats->moe_layers[l].layer_idx, per_layer[l]);
    }
  }

  parallel::Communicator& dense_grad_group() const {
    return groups.dense_gradients != nullptr ? *groups.dense_gradients : *groups.data_parallel;
  }

  static std::vector<at::Tensor> Grads(const std::vector<at::Tensor>& params) {
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : params) grads.push_back(p.grad());
    return grads;
  }

  // Sum of squared gradient entries.
  static double SquaredNorm(const std::vector<at::Tensor>& params) {
    return SquaredNormSum(Grads(params));
  }

  // Sums gradients over their groups, then returns the global L2 norm and
  // scales every gradient to max_norm when above it. Dense gradients are equal
  // on all ranks after the sum; each expert's are counted once, on its owner
  // within the expert-parallel group.
  double SyncAndClip(double max_norm) {
    if (dense_sync != nullptr) {
      dense_sync->Finish();
    } else {
      parallel::AllReduceSum(dense_grad_group(), Grads(dense_params),
                             {.bucket_bytes = options.grad_bucket_bytes});
    }
    parallel::AllReduceSum(*groups.expert_data_parallel, Grads(expert_params));
    at::Tensor expert_sq = at::full({1}, SquaredNorm(expert_params), at::kDouble);
    const double sq =
        SquaredNorm(dense_params) + SumOver(*groups.expert_parallel, expert_sq).item<double>();
    const double norm = std::sqrt(sq);
    if (max_norm > 0 && norm > max_norm) {
      const double scale = max_norm / (norm + 1e-6);
      for (const Parameter& p : model.trainable_parameters()) {
        if (p.tensor.grad().defined()) p.tensor.mutable_grad().mul_(scale);
      }
    }
    return norm;
  }
};

Trainer::Trainer(MoeModel& model, const TokenDataset& data, const TrainOptions& options,
                 const parallel::ProcessGroups* groups)
    : impl_(std::make_unique<Impl>(model, data, options, groups)) {}

Trainer::~Trainer() = default;

MoeModel& Trainer::model() { return impl_->model; }
FusedAdamW& Trainer::optimizer() { return *impl_->optimizer; }
const parallel::ProcessGroups& Trainer::groups() const { return impl_->groups; }
const TrainOptions& Trainer::options() const { return impl_->options; }
int64_t Trainer::first_step() const { return impl_->first_step; }
void Trainer::set_first_step(int64_t step) { impl_->first_step = step; }
int64_t Trainer::num_sequences() const { return impl_->data.num_sequences(); }
int64_t Trainer::global_batch() const {
  return impl_->options.micro_batch_size * impl_->groups.data_parallel->size() *
         impl_->options.grad_accum_steps;
}

StepStats Trainer::Step(int64_t step) {
  // Collectives of the step get parallel.timeout_s, and a watchdog report names the step.
  const parallel::ScopedStep progress(step + 1);
  Impl& s = *impl_;
  const TrainOptions& o = s.options;
  const ModelOptions& mo = s.model.options();
  parallel::Communicator& dp = *s.groups.data_parallel;
  const auto start = std::chrono::steady_clock::now();
  const double expert_start = experts::ExpertComputeSeconds();
  const double comm_start = parallel::CommunicationWaitSeconds();
  const int64_t pcie_start = internal::PcieBytes();
  const int64_t mb = o.micro_batch_size;
  const int64_t per_micro = mb * dp.size();
  const std::vector<int64_t> global = s.sampler.GlobalBatch(step, per_micro * o.grad_accum_steps);

  // The normalizer is the trained-token count of the whole global batch.
  std::vector<Batch> micro;
  int64_t trained_here = 0;
  for (int64_t m = 0; m < o.grad_accum_steps; ++m) {
    auto first = global.begin() + m * per_micro + dp.rank() * mb;
    micro.push_back(s.data.Gather({first, first + mb}));
    trained_here += CountTrainedTokens(micro.back().labels);
  }
  const int64_t trained =
      std::max<int64_t>(1, SumOver(dp, at::full({1}, trained_here, at::kLong)).item<int64_t>());

  StepStats stats;
  stats.step = step + 1;
  stats.lr = ScheduledLr(o, step);
  const auto since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  const auto zero_start = std::chrono::steady_clock::now();
  s.optimizer->ZeroGrad();
  stats.optimizer_seconds = since(zero_start);
  double loss_here = 0, aux_here = 0;
  s.routing.BeginStep();
  for (const Batch& batch : micro) {
    std::optional<DenseAutocast> autocast;
    autocast.emplace(s.model.runtime().dense_device, o.dense_autocast);
    ForwardResult out = s.model.Forward(batch.input_ids, batch.position_ids, batch.segment_ids);
    LossSum ce = CausalLmLossSum(out.logits, batch.labels);
    autocast.reset();  // the loss terms below and backward run as recorded
    at::Tensor loss = ce.sum / static_cast<double>(trained);
    if (!out.moe_layers.empty()) {
      // One all-reduce: the counts, and the routing telemetry's sums beside them.
      at::Tensor routed = SumOver(dp, PackRoutingSums(out.moe_layers, s.routing.columns(mo)));
      at::Tensor layer_counts = routed.narrow(1, 0, mo.num_experts);
      if (mo.scoring == RouterScoring::kSoftmax) {
        // HF's balance loss over all MoE layers' decisions on this micro-batch
        // of the global batch: counts and token totals are summed over ranks,
        // each rank adds its share of the probability mass.
        at::Tensor aux =
            router::StepLoadBalancingLoss(SumOverLayers(out.moe_layers, &MoeLayerRouting::prob_sum),
                                          layer_counts, mo.num_experts_per_tok);
        aux_here += aux.item<double>();
        if (mo.router_aux_loss_coef > 0) {
          loss = loss + aux * (mo.router_aux_loss_coef / static_cast<double>(o.grad_accum_steps));
        }
      } else if (mo.aux_loss_alpha > 0) {
        // DeepSeek-V3's sequence-wise loss: per MoE layer, the mean over the
        // micro-batch's sequences (of all ranks); the layers' losses add up.
        at::Tensor aux = SumOverLayers(out.moe_layers, &MoeLayerRouting::seq_balance_sum) /
                         static_cast<double>(per_micro);
        aux_here += aux.item<double>();
        loss = loss + aux * (mo.aux_loss_alpha / static_cast<double>(o.grad_accum_steps));
      }
      s.routing.AddMicroBatch(routed, out.moe_layers, mo, per_micro);
    }
    loss_here += ce.sum.item<double>();
    // The last backward completes the gradients: its buckets go out as they fill.
    if (s.dense_sync != nullptr && &batch == &micro.back()) s.dense_sync->Arm();
    loss.backward();
    stats.tokens += batch.input_ids.numel() * dp.size();
  }
  at::Tensor sums = SumOver(dp, at::tensor({loss_here, aux_here}, at::kDouble));
  stats.loss = sums[0].item<double>() / static_cast<double>(trained);
  stats.aux_loss = sums[1].item<double>() / static_cast<double>(o.grad_accum_steps);
  const auto optimizer_start = std::chrono::steady_clock::now();
  stats.grad_norm = s.SyncAndClip(o.optimizer.max_grad_norm);
  s.optimizer->Step(stats.lr);  // also refreshes the experts' compute copies
  stats.optimizer_seconds += since(optimizer_start);
  // Aux-loss-free balancing (DeepSeek-V3), from the global batch's counts.
  if (o.bias_update_rate > 0) {
    router::UpdateCorrectionBiases(s.routing.correction_biases(), s.routing.step_counts(),
                                   o.bias_update_rate);
  }

  s.routing.EndStep(&stats);
  if (o.gpu_cache_experts > 0 && !stats.moe_layers.empty()) s.UpdateCache(step + 1, &stats);
  const internal::ProcessMemory memory =
      internal::ReadProcessMemory(s.model.runtime().dense_device);
  stats.host_rss_bytes = memory.host_rss_bytes;
  stats.host_peak_bytes = memory.host_peak_bytes;
  stats.gpu_allocated_bytes = memory.gpu_allocated_bytes;
  stats.gpu_peak_bytes = memory.gpu_peak_bytes;
  stats.seconds = since(start);
  stats.expert_seconds = experts::ExpertComputeSeconds() - expert_start;
  stats.comm_seconds = parallel::CommunicationWaitSeconds() - comm_start;
  stats.pcie_bytes = internal::PcieBytes() - pcie_start;
  return stats;
}

namespace {

std::string FormatDuration(double seconds) {
  const int64_t s = static_cast<int64_t>(std::llround(seconds));
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%ds", s);
}

}  // namespace

absl::StatusOr<std::vector<StepStats>> Trainer::Run(
    std::ostream& log, const std::function<void(const StepStats&)>& after_step,
    const StepEndHook& at_step_end) {
  const TrainOptions& o = impl_->options;
  const bool rank0 = impl_->groups.world->rank() == 0;
  std::ofstream metrics;
  if (rank0 && !o.metrics_file.empty()) {
    metrics.open(o.metrics_file, std::ios::app);
    if (!metrics) {
      return absl::InvalidArgumentError(
          absl::StrCat("logging.metrics_file: cannot open '", o.metrics_file, "' for writing"));
    }
  }
  std::unique_ptr<TensorBoardWriter> tensorboard;
  if (rank0 && !o.tensorboard_dir.empty()) {
    absl::StatusOr<std::unique_ptr<TensorBoardWriter>> w =
        TensorBoardWriter::Open(o.tensorboard_dir, impl_->first_step + 1);
    if (!w.ok()) return w.status();
    tensorboard = *std::move(w);
  }
  // The expert map of a step: into its PNG file and, given a summary, into
  // TensorBoard; the last one drawn is kept for expert-map.png.
  int64_t last_map_step = 0;
  std::string last_map_png;
  auto draw_map = [&](const StepStats& st, tensorboard::Summary* summary) -> absl::Status {
    absl::StatusOr<RgbImage> image = DrawExpertMap(StepExpertMap(st));
    if (!image.ok()) return image.status();
    absl::StatusOr<std::string> png = EncodePng(*image);
    if (!png.ok()) return png.status();
    if (!o.expert_map_dir.empty()) {
      const std::filesystem::path dir(o.expert_map_dir);
      MOEFIT_RETURN_IF_ERROR(
          WriteTextFile(dir / absl::StrFormat("expert-map-step-%08d.png", st.step), *png));
    }
    if (summary != nullptr) AddPngImage(summary, "expert_map", *png, image->width, image->height);
    last_map_step = st.step;
    last_map_png = *std::move(png);
    return absl::OkStatus();
  };
  std::vector<StepStats> all;
  double elapsed = 0;
  const int64_t first = impl_->first_step;
  for (int64_t step = first; step < o.steps; ++step) {
    StepStats st = Step(step);
    elapsed += st.seconds;
    const double tok_s = st.seconds > 0 ? st.tokens / st.seconds : 0.0;
    const double eta = elapsed / (step - first + 1) * (o.steps - step - 1);
    if (rank0 && (o.log_every <= 1 || st.step % o.log_every == 0 || st.step == o.steps)) {
      log << absl::StrFormat(
                 "step %d/%d | loss %.4f | aux %.4f | lr %.2e | gnorm %.3f | %.0f tok/s | eta %s",
                 st.step, o.steps, st.loss, st.aux_loss, st.lr, st.grad_norm, tok_s,
                 FormatDuration(eta))
          << std::endl;
    }
    if (metrics.is_open()) {
      MOEFIT_ASSIGN_OR_RETURN(const std::string line,
                              MetricsLine(StepMetricsOf(st, o, tok_s, eta)));
      metrics << line << '\n';
      metrics.flush();
    }
    if (rank0 && (tensorboard != nullptr || o.expert_map_every_steps > 0)) {
      tensorboard::Summary summary;
      if (tensorboard != nullptr) summary = StepSummary(st, tok_s);
      if (o.expert_map_every_steps > 0 && st.step % o.expert_map_every_steps == 0) {
        MOEFIT_RETURN_IF_ERROR(draw_map(st, tensorboard != nullptr ? &summary : nullptr));
      }
      if (tensorboard != nullptr) {
        absl::Status s = tensorboard->Write(st.step, summary);
        if (!s.ok()) return s;
      }
    }
    if (after_step) after_step(st);
    all.push_back(std::move(st));
    if (at_step_end) {
      absl::StatusOr<bool> stop = at_step_end(step + 1);
      if (!stop.ok()) return stop.status();
      if (*stop) break;
    }
  }
  // The map of the last step, drawn unless it already was, as expert-map.png.
  if (rank0 && o.expert_map_every_steps > 0 && !all.empty()) {
    if (last_map_step != all.back().step) {
      tensorboard::Summary summary;
      MOEFIT_RETURN_IF_ERROR(draw_map(all.back(), tensorboard != nullptr ? &summary : nullptr));
      if (tensorboard != nullptr) {
        MOEFIT_RETURN_IF_ERROR(tensorboard->Write(all.back().step, summary));
      }
    }
    if (!o.expert_map_dir.empty()) {
      MOEFIT_RETURN_IF_ERROR(
          WriteTextFile(std::filesystem::path(o.expert_map_dir) / "expert-map.png", last_map_png));
    }
  }
  return all;
}

}  // namespace moefit::framework
