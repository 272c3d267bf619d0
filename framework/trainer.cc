// The training loop; see trainer.h.
#include "framework/trainer.h"

#include <ATen/ATen.h>
#include <google/protobuf/util/json_util.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "proto/metrics.pb.h"
#include "router/gating.h"

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

struct Trainer::Impl {
  MoeModel& model;
  const TokenDataset& data;
  TrainOptions options;
  BatchSampler sampler;
  std::unique_ptr<torch::optim::AdamW> optimizer;

  Impl(MoeModel& m, const TokenDataset& d, const TrainOptions& o)
      : model(m), data(d), options(o), sampler(d.num_sequences(), o.seed) {
    // Two groups: decayed weights, and norms/biases without weight decay.
    std::vector<at::Tensor> decay, no_decay;
    for (const Parameter& p : model.parameters()) {
      (p.weight_decay ? decay : no_decay).push_back(p.tensor);
    }
    auto group_options = [&](double wd) {
      auto opts = std::make_unique<torch::optim::AdamWOptions>(o.optimizer.lr);
      opts->betas({o.optimizer.beta1, o.optimizer.beta2}).eps(o.optimizer.eps).weight_decay(wd);
      return opts;
    };
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decay, group_options(o.optimizer.weight_decay));
    groups.emplace_back(no_decay, group_options(0.0));
    optimizer = std::make_unique<torch::optim::AdamW>(
        groups, torch::optim::AdamWOptions(o.optimizer.lr));
  }

  // Global L2 norm of all gradients; scales them to max_norm when above it.
  double ClipGradients(double max_norm) {
    double sq = 0;
    for (const Parameter& p : model.parameters()) {
      if (p.tensor.grad().defined()) {
        sq += p.tensor.grad().to(at::kDouble).pow(2).sum().item<double>();
      }
    }
    const double norm = std::sqrt(sq);
    if (max_norm > 0 && norm > max_norm) {
      const double scale = max_norm / (norm + 1e-6);
      for (const Parameter& p : model.parameters()) {
        if (p.tensor.grad().defined()) p.tensor.mutable_grad().mul_(scale);
      }
    }
    return norm;
  }
};

Trainer::Trainer(MoeModel& model, const TokenDataset& data, const TrainOptions& options)
    : impl_(std::make_unique<Impl>(model, data, options)) {}

Trainer::~Trainer() = default;

StepStats Trainer::Step(int64_t step) {
  Impl& s = *impl_;
  const TrainOptions& o = s.options;
  const ModelOptions& mo = s.model.options();
  const auto start = std::chrono::steady_clock::now();
  const int64_t mb = o.micro_batch_size;
  const std::vector<int64_t> global = s.sampler.GlobalBatch(step, mb * o.grad_accum_steps);

  // The normalizer is the trained-token count of the whole global batch.
  std::vector<Batch> micro;
  int64_t trained = 0;
  for (int64_t m = 0; m < o.grad_accum_steps; ++m) {
    micro.push_back(s.data.Gather({global.begin() + m * mb, global.begin() + (m + 1) * mb}));
    trained += CountTrainedTokens(micro.back().labels);
  }

  StepStats stats;
  stats.step = step + 1;
  stats.lr = ScheduledLr(o, step);
  s.optimizer->zero_grad();
  double loss_sum = 0, aux_sum = 0;
  std::vector<at::Tensor> load;  // per MoE layer: [E] assignment counts
  for (const Batch& batch : micro) {
    ForwardResult out = s.model.Forward(batch.input_ids);
    LossSum ce = CausalLmLossSum(out.logits, batch.labels);
    at::Tensor loss = ce.sum / static_cast<double>(std::max<int64_t>(trained, 1));
    if (!out.moe_layers.empty()) {
      at::Tensor prob_sum = out.moe_layers[0].prob_sum;
      at::Tensor count = out.moe_layers[0].expert_count;
      int64_t tokens = out.moe_layers[0].num_tokens;
      for (size_t l = 1; l < out.moe_layers.size(); ++l) {
        prob_sum = prob_sum + out.moe_layers[l].prob_sum;
        count = count + out.moe_layers[l].expert_count;
        tokens += out.moe_layers[l].num_tokens;
      }
      at::Tensor aux = router::LoadBalancingLoss(prob_sum, count, tokens, mo.num_experts);
      aux_sum += aux.item<double>();
      if (mo.router_aux_loss_coef > 0) {
        loss = loss + aux * (mo.router_aux_loss_coef / static_cast<double>(o.grad_accum_steps));
      }
      if (load.empty()) load.resize(out.moe_layers.size());
      for (size_t l = 0; l < out.moe_layers.size(); ++l) {
        load[l] = load[l].defined() ? load[l] + out.moe_layers[l].expert_count
                                    : out.moe_layers[l].expert_count;
      }
    }
    loss_sum += ce.sum.item<double>();
    loss.backward();
    stats.tokens += batch.input_ids.numel();
  }
  stats.loss = loss_sum / static_cast<double>(std::max<int64_t>(trained, 1));
  stats.aux_loss = aux_sum / static_cast<double>(o.grad_accum_steps);
  stats.grad_norm = s.ClipGradients(o.optimizer.max_grad_norm);
  for (auto& group : s.optimizer->param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(stats.lr);
  }
  s.optimizer->step();

  const auto& moe_layers = s.model.options();
  (void)moe_layers;
  int64_t layer_pos = 0;
  for (int64_t l = 0; l < mo.num_hidden_layers && layer_pos < static_cast<int64_t>(load.size());
       ++l) {
    if (!mo.IsMoeLayer(l)) continue;
    at::Tensor c = load[layer_pos++].to(at::kLong);
    LayerLoad ll;
    ll.layer_idx = l;
    ll.tokens_per_expert.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
    const double mean = c.to(at::kDouble).mean().item<double>();
    ll.max_over_mean = mean > 0 ? c.max().item<int64_t>() / mean : 0.0;
    stats.moe_layers.push_back(std::move(ll));
  }
  stats.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
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

absl::StatusOr<std::vector<StepStats>> Trainer::Run(std::ostream& log) {
  const TrainOptions& o = impl_->options;
  std::ofstream metrics;
  if (!o.metrics_file.empty()) {
    metrics.open(o.metrics_file, std::ios::app);
    if (!metrics) {
      return absl::InvalidArgumentError(
          absl::StrCat("logging.metrics_file: cannot open '", o.metrics_file, "' for writing"));
    }
  }
  std::vector<StepStats> all;
  double elapsed = 0;
  for (int64_t step = 0; step < o.steps; ++step) {
    StepStats st = Step(step);
    elapsed += st.seconds;
    const double tok_s = st.seconds > 0 ? st.tokens / st.seconds : 0.0;
    const double eta = elapsed / (step + 1) * (o.steps - step - 1);
    if (o.log_every <= 1 || st.step % o.log_every == 0 || st.step == o.steps) {
      log << absl::StrFormat(
                 "step %d/%d | loss %.4f | aux %.4f | lr %.2e | gnorm %.3f | %.0f tok/s | eta %s",
                 st.step, o.steps, st.loss, st.aux_loss, st.lr, st.grad_norm, tok_s,
                 FormatDuration(eta))
          << std::endl;
    }
    if (metrics.is_open()) {
      proto::StepMetrics m;
      m.set_step(st.step);
      m.set_total_steps(o.steps);
      m.set_loss(st.loss);
      m.set_aux_loss(st.aux_loss);
      m.set_lr(st.lr);
      m.set_grad_norm(st.grad_norm);
      m.set_tokens_per_s(tok_s);
      m.set_eta_s(eta);
      m.set_tokens(st.tokens);
      for (const LayerLoad& ll : st.moe_layers) {
        proto::LayerLoad* pl = m.add_moe_layers();
        pl->set_layer(ll.layer_idx);
        for (int64_t c : ll.tokens_per_expert) pl->add_tokens_per_expert(c);
        pl->set_max_over_mean(ll.max_over_mean);
      }
      std::string line;
      google::protobuf::util::JsonPrintOptions jo;
      jo.preserve_proto_field_names = true;
      jo.always_print_primitive_fields = true;
      if (!google::protobuf::util::MessageToJsonString(m, &line, jo).ok()) {
        return absl::InternalError("cannot serialize metrics");
      }
      metrics << line << '\n';
      metrics.flush();
    }
    all.push_back(std::move(st));
  }
  return all;
}

}  // namespace moefit::framework
