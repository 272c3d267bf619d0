// The shared MoE decoder; see model.h. Numerics follow HF transformers
// (Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM) op for op.
#include "framework/model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "experts/expert_function.h"
#include "experts/registry.h"
#include "parallel/dispatcher.h"
#include "parallel/local_communicator.h"
#include "router/gating.h"

namespace moefit::framework {

struct MoeModel::Layer {
  int64_t idx = 0;
  bool moe = false;
  at::Tensor input_norm, post_attn_norm;
  at::Tensor q_proj, k_proj, v_proj, o_proj;
  at::Tensor q_bias, k_bias, v_bias;  // defined when attention_bias
  at::Tensor q_norm, k_norm;          // defined when qk_norm
  // Dense MLP (dense layers) or shared expert (MoE layers of qwen2_moe).
  at::Tensor mlp_gate, mlp_up, mlp_down;
  at::Tensor shared_gate;  // [1, H] qwen2_moe shared_expert_gate
  at::Tensor router;       // [E, H]
  at::Tensor gate_up_proj, down_proj;  // packed experts, CPU
};

namespace {

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(x.scalar_type());
}

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

at::Tensor SwiGlu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                  const at::Tensor& down) {
  return at::linear(at::silu(at::linear(x, gate)) * at::linear(x, up), down);
}

}  // namespace

bool ModelOptions::IsMoeLayer(int64_t layer_idx) const {
  for (int64_t l : mlp_only_layers) {
    if (l == layer_idx) return false;
  }
  return num_experts > 0 && decoder_sparse_step > 0 && (layer_idx + 1) % decoder_sparse_step == 0;
}

MoeModel::MoeModel(const ModelOptions& options, const ModelRuntime& runtime,
                   router::ExpertPlacement placement)
    : options_(options), runtime_(runtime), placement_(std::move(placement)) {}

MoeModel::~MoeModel() = default;

absl::StatusOr<std::unique_ptr<MoeModel>> MoeModel::Create(const ModelOptions& options,
                                                           const ModelRuntime& runtime,
                                                           uint64_t seed) {
  auto backend =
      experts::CreateExpertBackend(runtime.expert_backend, {.num_threads = runtime.expert_threads});
  if (!backend.ok()) return backend.status();
  ModelRuntime rt = runtime;
  if (rt.expert_group == nullptr) rt.expert_group = parallel::LocalCommunicator::Create("ep");
  auto placement = router::ExpertPlacement::Contiguous(options.num_experts, rt.expert_group->size());
  if (!placement.ok()) return placement.status();
  auto dispatcher = parallel::CreateDispatcher(rt.dispatcher, rt.expert_group, *placement);
  if (!dispatcher.ok()) return dispatcher.status();
  std::unique_ptr<MoeModel> model(new MoeModel(options, rt, std::move(*placement)));
  model->backend_ = std::move(*backend);
  model->dispatcher_ = std::move(*dispatcher);
  model->Build(seed);
  return model;
}

void MoeModel::Build(uint64_t seed) {
  const ModelOptions& o = options_;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t h = o.hidden_size, hd = o.head_dim;
  // Every tensor is drawn on the CPU in a fixed order, then moved: the same
  // seed gives the same weights on any device and at any expert dtype.
  const int ep_rank = runtime_.expert_group->rank();
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool normal, bool decay,
                 bool expert) {
    at::Tensor t = normal ? at::randn(shape, gen, at::kFloat) * o.initializer_range
                          : (decay ? at::zeros(shape) : at::ones(shape));
    t = expert ? t.narrow(0, placement_.first_expert(ep_rank), placement_.num_local(ep_rank))
                     .to(runtime_.expert_dtype)
                     .clone()
               : t.to(runtime_.dense_device);
    t.requires_grad_(true);
    params_.push_back({name, t, decay, expert});
    return t;
  };
  auto linear = [&](const std::string& name, int64_t out, int64_t in) {
    return add(name + ".weight", {out, in}, true, true, false);
  };
  auto bias = [&](const std::string& name, int64_t n) {
    return add(name + ".bias", {n}, false, false, false);
  };
  auto norm = [&](const std::string& name, int64_t n) {
    return add(name + ".weight", {n}, false, false, false);
  };

  embed_tokens_ = add("model.embed_tokens.weight", {o.vocab_size, h}, true, true, false);
  for (int64_t i = 0; i < o.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    Layer l;
    l.idx = i;
    l.moe = o.IsMoeLayer(i);
    l.input_norm = norm(p + "input_layernorm", h);
    l.q_proj = linear(p + "self_attn.q_proj", o.num_attention_heads * hd, h);
    l.k_proj = linear(p + "self_attn.k_proj", o.num_key_value_heads * hd, h);
    l.v_proj = linear(p + "self_attn.v_proj", o.num_key_value_heads * hd, h);
    if (o.attention_bias) {
      l.q_bias = bias(p + "self_attn.q_proj", o.num_attention_heads * hd);
      l.k_bias = bias(p + "self_attn.k_proj", o.num_key_value_heads * hd);
      l.v_bias = bias(p + "self_attn.v_proj", o.num_key_value_heads * hd);
    }
    l.o_proj = linear(p + "self_attn.o_proj", h, o.num_attention_heads * hd);
    if (o.qk_norm) {
      l.q_norm = norm(p + "self_attn.q_norm", hd);
      l.k_norm = norm(p + "self_attn.k_norm", hd);
    }
    l.post_attn_norm = norm(p + "post_attention_layernorm", h);
    if (l.moe) {
      const int64_t inter = o.moe_intermediate_size;
      l.router = linear(p + "mlp.gate", o.num_experts, h);
      l.gate_up_proj =
          add(p + "mlp.experts.gate_up_proj", {o.num_experts, 2 * inter, h}, true, true, true);
      l.down_proj = add(p + "mlp.experts.down_proj", {o.num_experts, h, inter}, true, true, true);
      if (o.shared_expert_intermediate_size > 0) {
        const int64_t s = o.shared_expert_intermediate_size;
        l.mlp_gate = linear(p + "mlp.shared_expert.gate_proj", s, h);
        l.mlp_up = linear(p + "mlp.shared_expert.up_proj", s, h);
        l.mlp_down = linear(p + "mlp.shared_expert.down_proj", h, s);
        l.shared_gate = linear(p + "mlp.shared_expert_gate", 1, h);
      }
    } else {
      l.mlp_gate = linear(p + "mlp.gate_proj", o.intermediate_size, h);
      l.mlp_up = linear(p + "mlp.up_proj", o.intermediate_size, h);
      l.mlp_down = linear(p + "mlp.down_proj", h, o.intermediate_size);
    }
    layers_.push_back(std::move(l));
  }
  final_norm_ = norm("model.norm", h);
  lm_head_ = o.tie_word_embeddings ? embed_tokens_ : linear("lm_head", o.vocab_size, h);
}

at::Tensor MoeModel::Attention(const Layer& l, const at::Tensor& x, const at::Tensor& cos,
                               const at::Tensor& sin) {
  const ModelOptions& o = options_;
  const int64_t b = x.size(0), t = x.size(1), hd = o.head_dim;
  auto heads = [&](const at::Tensor& proj, const at::Tensor& bias, int64_t n) {
    return at::linear(x, proj, bias).view({b, t, n, hd});
  };
  at::Tensor q = heads(l.q_proj, l.q_bias, o.num_attention_heads);
  at::Tensor k = heads(l.k_proj, l.k_bias, o.num_key_value_heads);
  at::Tensor v = heads(l.v_proj, l.v_bias, o.num_key_value_heads).transpose(1, 2);
  if (o.qk_norm) {
    q = RmsNorm(q, l.q_norm, o.rms_norm_eps);
    k = RmsNorm(k, l.k_norm, o.rms_norm_eps);
  }
  q = q.transpose(1, 2);  // [B, heads, T, hd]
  k = k.transpose(1, 2);
  q = q * cos + RotateHalf(q) * sin;
  k = k * cos + RotateHalf(k) * sin;
  const int64_t groups = o.num_attention_heads / o.num_key_value_heads;
  if (groups > 1) {
    k = k.repeat_interleave(groups, 1);
    v = v.repeat_interleave(groups, 1);
  }
  at::Tensor attn = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                     /*is_causal=*/true);
  return at::linear(attn.transpose(1, 2).reshape({b, t, o.num_attention_heads * hd}), l.o_proj);
}

at::Tensor MoeModel::Moe(const Layer& l, const at::Tensor& x, MoeLayerRouting* routing) {
  const ModelOptions& o = options_;
  const int64_t k = o.num_experts_per_tok;
  // a. Router on the dense device.
  router::TopKRouting r = router::SoftmaxTopK(
      at::linear(x, l.router), {.num_experts_per_tok = k, .norm_topk_prob = o.norm_topk_prob});
  router::BalanceStats stats = router::ComputeBalanceStats(r, o.num_experts);
  routing->layer_idx = l.idx;
  routing->prob_sum = stats.prob_sum;
  routing->expert_count = stats.expert_count.to(at::kCPU);

  // c. Activations to the host, in the experts' dtype.
  at::Tensor x_host = x.to(at::kCPU).to(runtime_.expert_dtype);
  // d-e. Remap and dispatch each (token, slot) row to the owner of its expert.
  parallel::DispatchedRows rows = dispatcher_->Dispatch(x_host, r.topk_idx.to(at::kCPU));
  // f. Expert compute on this rank's experts.
  at::Tensor y = experts::ExpertFfn(*backend_, rows.rows, rows.counts, l.gate_up_proj, l.down_proj);
  // g. Combine: rows come home; routing weights are applied here.
  at::Tensor back = dispatcher_->Combine(y, *rows.route).to(at::kFloat).view({x.size(0), k, -1});
  at::Tensor out = (back * r.topk_weight.to(at::kCPU).unsqueeze(-1))
                       .sum(1)
                       .to(x.scalar_type())
                       .to(x.device());
  if (l.shared_gate.defined()) {
    out = out + at::sigmoid(at::linear(x, l.shared_gate)) *
                    SwiGlu(x, l.mlp_gate, l.mlp_up, l.mlp_down);
  }
  return out;
}

ForwardResult MoeModel::Forward(const at::Tensor& input_ids) {
  const ModelOptions& o = options_;
  const c10::Device dev = runtime_.dense_device;
  at::Tensor ids = input_ids.to(dev);
  const int64_t b = ids.size(0), t = ids.size(1);
  ForwardResult result;

  // RoPE tables: inv_freq = theta^(-2i/d), emb = [freqs, freqs].
  at::Tensor inv_freq =
      1.0 / at::pow(o.rope_theta, at::arange(0, o.head_dim, 2, at::TensorOptions(dev).dtype(at::kLong))
                                          .to(at::kFloat) /
                                      static_cast<double>(o.head_dim));
  at::Tensor freqs = at::outer(at::arange(t, at::TensorOptions(dev).dtype(at::kFloat)), inv_freq);
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  at::Tensor cos = emb.cos(), sin = emb.sin();

  at::Tensor hidden = at::embedding(embed_tokens_, ids);
  for (const Layer& l : layers_) {
    hidden = hidden + Attention(l, RmsNorm(hidden, l.input_norm, o.rms_norm_eps), cos, sin);
    at::Tensor normed = RmsNorm(hidden, l.post_attn_norm, o.rms_norm_eps);
    if (l.moe) {
      MoeLayerRouting routing;
      at::Tensor flat = normed.reshape({b * t, o.hidden_size});
      hidden = hidden + Moe(l, flat, &routing).view({b, t, o.hidden_size});
      result.moe_layers.push_back(std::move(routing));
    } else {
      hidden = hidden + SwiGlu(normed, l.mlp_gate, l.mlp_up, l.mlp_down);
    }
  }
  result.logits = at::linear(RmsNorm(hidden, final_norm_, o.rms_norm_eps), lm_head_).to(at::kFloat);
  return result;
}

LossSum CausalLmLossSum(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t t = logits.size(1);
  at::Tensor shift_logits = logits.narrow(1, 0, t - 1).reshape({-1, logits.size(2)});
  at::Tensor shift_labels = labels.to(logits.device()).narrow(1, 1, t - 1).reshape({-1});
  LossSum out;
  out.sum = at::cross_entropy_loss(shift_logits, shift_labels, /*weight=*/{},
                                   at::Reduction::Sum, /*ignore_index=*/-100);
  out.num_tokens = CountTrainedTokens(labels);
  return out;
}

int64_t CountTrainedTokens(const at::Tensor& labels) {
  return labels.narrow(1, 1, labels.size(1) - 1).ne(-100).sum().item<int64_t>();
}

}  // namespace moefit::framework
