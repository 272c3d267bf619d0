// The trainer's routing telemetry; see routing_telemetry.h.
#include "framework/routing_telemetry.h"

#include <ATen/ATen.h>

#include <cmath>

#include "framework/trainer.h"
#include "router/balance.h"

namespace moefit::framework {

at::Tensor PackRoutingSums(const std::vector<MoeLayerRouting>& layers,
                           const RoutingColumns& columns) {
  const int64_t e = columns.num_experts;
  at::Tensor packed =
      at::zeros({static_cast<int64_t>(layers.size()), columns.width()}, at::kDouble);
  for (size_t l = 0; l < layers.size(); ++l) {
    const MoeLayerRouting& r = layers[l];
    at::Tensor row = packed[static_cast<int64_t>(l)];
    row.narrow(0, 0, e).copy_(r.expert_count);
    if (!columns.telemetry) continue;
    row.narrow(0, columns.prob_sum(), e).copy_(r.prob_sum.detach());
    if (r.entropy_sum.defined()) row[columns.entropy_sum()].copy_(r.entropy_sum);
    if (r.seq_balance_sum.defined())
      row[columns.seq_balance_sum()].copy_(r.seq_balance_sum.detach());
  }
  return packed;
}

void RoutingTelemetry::BeginStep() {
  num_micro_ = 0;
  sums_ = at::Tensor();
  balance_loss_.clear();
  has_balance_loss_ = false;
}

void RoutingTelemetry::AddMicroBatch(const at::Tensor& global_sums,
                                     const std::vector<MoeLayerRouting>& layers,
                                     const ModelOptions& model, int64_t num_sequences) {
  columns_ = columns(model);
  num_experts_per_tok_ = model.num_experts_per_tok;
  if (layer_idx_.empty()) {
    for (const MoeLayerRouting& r : layers) {
      layer_idx_.push_back(r.layer_idx);
      correction_biases_.push_back(r.correction_bias);
    }
  }
  sums_ = sums_.defined() ? sums_ + global_sums : global_sums.clone();
  ++num_micro_;
  if (!options_.enabled) return;
  // The layer's own balance loss on this micro-batch, as the model's loss
  // forms it over all layers: the Switch loss of softmax routers, the
  // sequence-wise loss of sigmoid routers that have one.
  const int64_t num_layers = global_sums.size(0), e = model.num_experts;
  balance_loss_.resize(static_cast<size_t>(num_layers), 0.0);
  const at::Tensor s = global_sums.contiguous();
  const double* p = s.data_ptr<double>();
  for (int64_t l = 0; l < num_layers; ++l) {
    const double* row = p + l * columns_.width();
    double loss = 0;
    if (model.scoring == RouterScoring::kSoftmax) {
      // The Switch loss of this layer alone, in double.
      const at::Tensor counts = s[l].narrow(0, 0, e);
      const int64_t tokens = std::llround(counts.sum().item<double>()) / model.num_experts_per_tok;
      if (tokens <= 0) continue;
      loss = router::LoadBalancingLoss(s[l].narrow(0, columns_.prob_sum(), e), counts, tokens, e)
                 .item<double>();
      has_balance_loss_ = true;
    } else if (model.aux_loss_alpha > 0) {
      loss = row[columns_.seq_balance_sum()] / static_cast<double>(num_sequences);
      has_balance_loss_ = true;
    }
    balance_loss_[static_cast<size_t>(l)] += loss;
  }
}

at::Tensor RoutingTelemetry::step_counts() const {
  return sums_.defined() ? sums_.narrow(1, 0, columns_.num_experts) : at::Tensor();
}

void RoutingTelemetry::EndStep(StepStats* stats) {
  if (!sums_.defined()) return;
  const int64_t num_layers = sums_.size(0), e = columns_.num_experts;
  const at::Tensor counts = step_counts().contiguous();
  const double* c = counts.data_ptr<double>();
  if (options_.enabled) {
    if (decayed_.num_layers() != num_layers) {
      decayed_ = router::DecayedExpertLoad(num_layers, e, options_.half_life_steps);
    }
    decayed_.Update(std::span<const double>(c, static_cast<size_t>(num_layers * e)));
  }
  const at::Tensor sums = sums_.contiguous();
  for (int64_t l = 0; l < num_layers; ++l) {
    const std::span<const double> layer(c + l * e, static_cast<size_t>(e));
    LayerLoad ll;
    ll.layer_idx = layer_idx_[static_cast<size_t>(l)];
    ll.tokens_per_expert.reserve(static_cast<size_t>(e));
    double assignments = 0;
    for (double x : layer) {
      ll.tokens_per_expert.push_back(static_cast<int64_t>(std::llround(x)));
      assignments += x;
    }
    const router::LoadImbalance imbalance = router::ComputeLoadImbalance(layer);
    ll.max_over_mean = imbalance.max_over_mean;
    if (options_.enabled) {
      ll.cv = imbalance.cv;
      const std::span<const double> d = decayed_.layer(l);
      ll.decayed_load.assign(d.begin(), d.end());
      const double tokens = assignments / static_cast<double>(num_experts_per_tok_);
      ll.router_entropy =
          tokens > 0 ? sums[l][columns_.entropy_sum()].item<double>() / tokens : 0.0;
      if (has_balance_loss_) {
        ll.balance_loss = balance_loss_[static_cast<size_t>(l)] / static_cast<double>(num_micro_);
      }
      const at::Tensor& bias = correction_biases_[static_cast<size_t>(l)];
      if (bias.defined()) {
        const at::Tensor b = bias.detach().to(at::kCPU, at::kDouble).contiguous();
        ll.correction_bias = router::ComputeSpread(
            std::span<const double>(b.data_ptr<double>(), static_cast<size_t>(b.numel())));
      }
    }
    stats->moe_layers.push_back(std::move(ll));
  }
}

}  // namespace moefit::framework
