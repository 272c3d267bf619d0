// The shared MoE decoder; see model.h. Numerics follow HF transformers
// (Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM,
// DeepseekV3ForCausalLM, Glm4MoeForCausalLM) op for op.
#include "framework/model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/accumulate.h>

#include <cmath>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "checkpoint/fp8.h"
#include "experts/expert_function.h"
#include "experts/int4.h"
#include "experts/kernels/gemm.h"
#include "experts/registry.h"
#include "framework/attention.h"
#include "framework/internal/host_transfer.h"
#include "framework/recompute.h"
#include "parallel/dispatcher.h"
#include "parallel/local_communicator.h"
#include "parallel/progress.h"
#include "proto/status_macros.h"
#include "router/balance.h"
#include "router/gating.h"
#include "router/routing_stats.h"

namespace moefit::framework {
namespace {

// A SwiGLU MLP: down(silu(gate·x) ⊙ up·x), each projection with its adapter.
struct SwiGluWeights {
  at::Tensor gate, up, down;
  LoraAdapter gate_lora, up_lora, down_lora;
};

}  // namespace

struct MoeModel::Layer {
  int64_t idx = 0;
  bool moe = false;
  at::Tensor input_norm, post_attn_norm;
  GqaWeights gqa;     // GQA attention
  LatentWeights mla;  // or multi-head latent attention
  // Dense MLP (dense layers) or shared expert(s) (MoE layers).
  SwiGluWeights mlp;
  at::Tensor shared_gate;  // [1, H] qwen2_moe shared_expert_gate; undefined: ungated
  LoraAdapter shared_gate_lora;
  at::Tensor router;                   // [E, H]
  at::Tensor correction_bias;          // [E] fp32 e_score_correction_bias (sigmoid routers)
  at::Tensor gate_up_proj, down_proj;  // packed experts, CPU
  // With expert_master_weights: the copies in expert_dtype the experts compute
  // with (gate_up_proj and down_proj are then the float32 masters).
  at::Tensor gate_up_compute, down_compute;
  // FP8 experts: float32 scales per 128 x 128 block, [E_local, 2I/128, ceil(H/128)]
  // and [E_local, ceil(H/128), I/128]. int4 experts: bfloat16 group scales,
  // and int8 zero points where the scheme has them (experts::ExpertWeights).
  at::Tensor gate_up_scale, down_scale;
  at::Tensor gate_up_zero_point, down_zero_point;
  experts::ExpertLora expert_lora;  // their adapters (LoRA), CPU
  // The module prefix of the MLP or shared expert(s) ("mlp", "mlp.shared_expert", ...).
  std::string mlp_name;
};

namespace {

at::Tensor SwiGlu(const at::Tensor& x, const SwiGluWeights& w) {
  return Linear(at::silu(Linear(x, w.gate, {}, w.gate_lora)) * Linear(x, w.up, {}, w.up_lora),
                w.down, {}, w.down_lora);
}

// SplitMix64: independent generator seeds from (seed, what).
uint64_t MixSeed(uint64_t seed, uint64_t what) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (what + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// PEFT's LoRA A: kaiming_uniform_(a=sqrt(5)) over fan_in = in, i.e. U(-1/sqrt(in), 1/sqrt(in)).
void DrawLoraA(at::Tensor a, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double bound = 1.0 / std::sqrt(static_cast<double>(a.size(-1)));
  a.uniform_(-bound, bound, gen);
}

}  // namespace

std::string ScaleInvName(const std::string& weight_name) {
  return absl::StrCat(weight_name, std::string(checkpoint::kScaleInvSuffix));
}

std::string Int4ScaleName(const std::string& weight_name) {
  return absl::StrCat(weight_name, "_scale");
}

std::string Int4ZeroPointName(const std::string& weight_name) {
  return absl::StrCat(weight_name, "_zero_point");
}

absl::Status CheckFp8Experts(const ModelOptions& o) {
  constexpr int64_t kBlock = experts::kernels::kScaleBlock;
  if (o.fp8_weight_block &&
      ((*o.fp8_weight_block)[0] != kBlock || (*o.fp8_weight_block)[1] != kBlock)) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 experts are multiplied in 128 x 128 scale blocks; this checkpoint's "
                     "quantization_config.weight_block_size is [",
                     (*o.fp8_weight_block)[0], ", ", (*o.fp8_weight_block)[1], "]"));
  }
  if (o.moe_intermediate_size % kBlock != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FP8 experts need moe_intermediate_size a multiple of 128 (gate and up each fill whole "
        "scale blocks); this model's is ",
        o.moe_intermediate_size));
  }
  return absl::OkStatus();
}

MoeModel::MoeModel(const ModelOptions& options, const ModelRuntime& runtime,
                   router::ExpertPlacement placement)
    : options_(options), runtime_(runtime), placement_(std::move(placement)) {}

MoeModel::~MoeModel() = default;

absl::StatusOr<std::unique_ptr<MoeModel>> MoeModel::Create(const ModelOptions& options,
                                                           const ModelRuntime& runtime,
                                                           uint64_t seed, WeightInit init) {
  auto backend = experts::CreateExpertBackend(runtime.expert_backend,
                                              {.num_threads = runtime.expert_threads,
                                               .thread_pool = runtime.expert_thread_pool,
                                               .packed_weight_bytes = runtime.expert_packed_bytes});
  if (!backend.ok()) return backend.status();
  ModelRuntime rt = runtime;
  if (rt.expert_group == nullptr) rt.expert_group = parallel::LocalCommunicator::Create("ep");
  auto placement =
      router::ExpertPlacement::Contiguous(options.num_experts, rt.expert_group->size());
  if (!placement.ok()) return placement.status();
  auto dispatcher = parallel::CreateDispatcher(rt.dispatcher, rt.expert_group, *placement);
  if (!dispatcher.ok()) return dispatcher.status();
  std::unique_ptr<MoeModel> model(new MoeModel(options, rt, std::move(*placement)));
  model->backend_ = std::move(*backend);
  model->dispatcher_ = std::move(*dispatcher);
  if (rt.expert_cache_device) {
    if (rt.quantized_experts()) {
      return absl::InvalidArgumentError(
          "experts.gpu_cache_experts computes float32 or bfloat16 experts on the GPU; these are "
          "stored quantized (FP8 or int4)");
    }
    auto cache_backend = experts::CreateExpertBackend("eager", {});
    if (!cache_backend.ok()) return cache_backend.status();
    model->cache_backend_ = std::move(*cache_backend);
  }
  if (rt.lora.enabled()) {
    absl::StatusOr<LoraTargets> targets = ResolveLoraTargets(options, rt.lora.target_modules);
    if (!targets.ok()) return targets.status();
    model->lora_targets_ = std::move(*targets);
  } else if (rt.dense_dtype != at::kFloat) {
    return absl::InvalidArgumentError(
        "dense weights narrower than float32 are for a frozen base only (train.mode lora)");
  }
  if (rt.expert_dtype == at::kFloat8_e4m3fn) {
    if (!rt.lora.enabled() && !rt.frozen_base) {
      return absl::InvalidArgumentError(
          "experts.dtype = 'float8_e4m3fn': FP8 experts are frozen, for train.mode lora (or moefit "
          "eval) only");
    }
    MOEFIT_RETURN_IF_ERROR(CheckFp8Experts(options));
  } else if (rt.expert_dtype == at::kByte) {
    if (!rt.lora.enabled() && !rt.frozen_base) {
      return absl::InvalidArgumentError(
          "experts.dtype = 'int4': int4 experts are frozen, for train.mode lora (or moefit eval) "
          "only");
    }
    if (rt.int4_group_size <= 0 || rt.int4_group_size % 2 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("int4 experts need an even group size; got ", rt.int4_group_size));
    }
  } else if (rt.expert_dtype != at::kFloat && rt.expert_dtype != at::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat("experts in ", c10::toString(rt.expert_dtype),
                                                   ": float32, bfloat16, float8_e4m3fn or int4"));
  }
  // Masters only where there is something narrower to master and to train.
  model->runtime_.expert_master_weights =
      rt.expert_master_weights && rt.expert_dtype != at::kFloat && !rt.lora.enabled();
  model->Build(seed, init);
  model->expert_caches_.resize(model->layers_.size());
  // Loaded weights are copied once loaded (LoadPretrained).
  if (init == WeightInit::kRandom) model->SyncExpertCopies();
  if (rt.lora.enabled()) model->AddAdapters(seed);
  return model;
}

at::Tensor RandnRows(at::IntArrayRef shape, int64_t first, int64_t num, double scale,
                     at::ScalarType dtype, at::Generator& gen) {
  const std::vector<int64_t> row_shape(shape.begin() + 1, shape.end());
  const int64_t row_numel = c10::multiply_integers(row_shape);
  if (row_numel == 0 || row_numel % 16 != 0) {
    return (at::randn(shape, gen, at::kFloat) * scale).narrow(0, first, num).to(dtype).clone();
  }
  std::vector<int64_t> out_shape = shape.vec();
  out_shape[0] = num;
  at::Tensor out = at::empty(out_shape, at::TensorOptions().dtype(dtype));
  // at::randn is at::empty then normal_(0, 1): the same call, one row at a time.
  at::Tensor row = at::empty(row_shape, at::TensorOptions().dtype(at::kFloat));
  for (int64_t r = 0; r < shape[0]; ++r) {
    row.normal_(0, 1, gen);
    if (r >= first && r < first + num) out.select(0, r - first).copy_(row * scale);
  }
  return out;
}

void MoeModel::Build(uint64_t seed, WeightInit init) {
  const ModelOptions& o = options_;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t h = o.hidden_size, hd = o.head_dim;
  // Every tensor is drawn on the CPU in a fixed order, then moved: the same
  // seed gives the same weights on any device and at any expert dtype.
  const int ep_rank = runtime_.expert_group->rank();
  const int64_t first_expert = placement_.first_expert(ep_rank);
  const int64_t num_local = placement_.num_local(ep_rank);
  const bool random = init == WeightInit::kRandom;
  // With master weights the expert parameters are float32; the compute copies
  // are made from them.
  const at::ScalarType expert_param_dtype =
      runtime_.expert_master_weights ? at::kFloat : runtime_.expert_dtype;
  // Under LoRA the base is frozen, and its matrices may stay narrow.
  const bool trained = !runtime_.lora.enabled() && !runtime_.frozen_base;
  // Frozen FP8 experts: each weight followed by its block scales; frozen int4
  // experts: by their group scales and zero points.
  const bool fp8 = runtime_.expert_dtype == at::kFloat8_e4m3fn;
  const bool int4 = runtime_.expert_dtype == at::kByte;
  constexpr int64_t kBlock = experts::kernels::kScaleBlock;
  // The scales (and int4 zero points) of the quantized expert weight `add` made last.
  at::Tensor fp8_scale, int4_zero_point;
  // `matrix`: a dense matrix stored in dense_dtype (else float32: norms, biases, routers).
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool normal, bool decay,
                 bool expert, bool matrix = false) {
    const at::ScalarType dense_dtype = matrix ? runtime_.dense_dtype : at::kFloat;
    at::Tensor t;
    if (expert && fp8) {
      // Drawn as float32, then quantized per block; the scales join the parameters.
      at::Tensor scale;
      if (random) {
        auto quantized = checkpoint::QuantizeBlockFp8(
            RandnRows(shape, first_expert, num_local, o.initializer_range, at::kFloat, gen),
            {kBlock, kBlock});
        TORCH_CHECK(quantized.ok(), name, ": ", quantized.status().ToString());
        std::tie(t, scale) = *std::move(quantized);
      } else {
        shape[0] = num_local;
        t = at::empty(shape, at::TensorOptions().dtype(at::kFloat8_e4m3fn));
        scale = at::empty(
            {num_local, (shape[1] + kBlock - 1) / kBlock, (shape[2] + kBlock - 1) / kBlock});
      }
      params_.push_back({name, t, decay, expert});
      params_.push_back({ScaleInvName(name), scale, /*weight_decay=*/false, expert});
      fp8_scale = scale;
      return t;
    }
    if (expert && int4) {
      // Drawn as float32, then quantized in groups; scales and zero points
      // join the parameters.
      const int64_t group = runtime_.int4_group_size, cols = shape[2];
      experts::Int4Weight q;
      if (random) {
        q = experts::QuantizeInt4(
            RandnRows(shape, first_expert, num_local, o.initializer_range, at::kFloat, gen), group,
            !runtime_.int4_zero_points);
      } else {
        const std::vector<int64_t> groups = {num_local, shape[1], (cols + group - 1) / group};
        q.bytes = at::empty({num_local, shape[1], experts::Int4RowBytes(cols)}, at::kByte);
        q.scale = at::empty(groups, at::kBFloat16);
        if (runtime_.int4_zero_points) q.zero_point = at::empty(groups, at::kChar);
      }
      params_.push_back({name, q.bytes, decay, expert});
      params_.push_back({Int4ScaleName(name), q.scale, /*weight_decay=*/false, expert});
      if (q.zero_point.defined()) {
        params_.push_back({Int4ZeroPointName(name), q.zero_point, /*weight_decay=*/false, expert});
      }
      fp8_scale = q.scale;
      int4_zero_point = q.zero_point;
      return q.bytes;
    }
    if (expert) {
      // This rank's experts only: never the other ranks' rows, drawn or not.
      if (random) {
        t = RandnRows(shape, first_expert, num_local, o.initializer_range, expert_param_dtype, gen);
      } else {
        shape[0] = num_local;
        t = at::empty(shape, at::TensorOptions().dtype(expert_param_dtype));
      }
    } else if (random) {
      t = normal ? at::randn(shape, gen, at::kFloat) * o.initializer_range
                 : (decay ? at::zeros(shape) : at::ones(shape));
      t = t.to(runtime_.dense_device, dense_dtype);
    } else {
      t = at::empty(shape, at::TensorOptions().dtype(dense_dtype).device(runtime_.dense_device));
    }
    t.requires_grad_(trained);
    params_.push_back({name, t, decay, expert});
    return t;
  };
  auto linear = [&](const std::string& name, int64_t out, int64_t in) {
    return add(name + ".weight", {out, in}, true, true, false, /*matrix=*/true);
  };
  auto bias = [&](const std::string& name, int64_t n) {
    return add(name + ".bias", {n}, false, false, false);
  };
  auto norm = [&](const std::string& name, int64_t n) {
    return add(name + ".weight", {n}, false, false, false);
  };
  auto swiglu = [&](const std::string& name, int64_t width, Layer& l) {
    l.mlp_name = name.substr(name.find("mlp"));
    l.mlp.gate = linear(name + ".gate_proj", width, h);
    l.mlp.up = linear(name + ".up_proj", width, h);
    l.mlp.down = linear(name + ".down_proj", h, width);
  };

  embed_tokens_ =
      add("model.embed_tokens.weight", {o.vocab_size, h}, true, true, false, /*matrix=*/true);
  for (int64_t i = 0; i < o.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    Layer l;
    l.idx = i;
    l.moe = o.IsMoeLayer(i);
    l.input_norm = norm(p + "input_layernorm", h);
    if (o.attention == AttentionKind::kMla) {
      const int64_t heads = o.num_attention_heads;
      LatentWeights& w = l.mla;
      if (o.q_lora_rank > 0) {
        w.q_a_proj = linear(p + "self_attn.q_a_proj", o.q_lora_rank, h);
        w.q_a_norm = norm(p + "self_attn.q_a_layernorm", o.q_lora_rank);
        w.q_b_proj = linear(p + "self_attn.q_b_proj", heads * o.qk_head_dim(), o.q_lora_rank);
      } else {
        w.q_proj = linear(p + "self_attn.q_proj", heads * o.qk_head_dim(), h);
      }
      w.kv_a_proj =
          linear(p + "self_attn.kv_a_proj_with_mqa", o.kv_lora_rank + o.qk_rope_head_dim, h);
      w.kv_a_norm = norm(p + "self_attn.kv_a_layernorm", o.kv_lora_rank);
      w.kv_b_proj = linear(p + "self_attn.kv_b_proj", heads * (o.qk_nope_head_dim + o.v_head_dim),
                           o.kv_lora_rank);
      w.o_proj = linear(p + "self_attn.o_proj", h, heads * o.v_head_dim);
    } else {
      GqaWeights& w = l.gqa;
      w.q_proj = linear(p + "self_attn.q_proj", o.num_attention_heads * hd, h);
      w.k_proj = linear(p + "self_attn.k_proj", o.num_key_value_heads * hd, h);
      w.v_proj = linear(p + "self_attn.v_proj", o.num_key_value_heads * hd, h);
      if (o.attention_bias) {
        w.q_bias = bias(p + "self_attn.q_proj", o.num_attention_heads * hd);
        w.k_bias = bias(p + "self_attn.k_proj", o.num_key_value_heads * hd);
        w.v_bias = bias(p + "self_attn.v_proj", o.num_key_value_heads * hd);
      }
      w.o_proj = linear(p + "self_attn.o_proj", h, o.num_attention_heads * hd);
      if (o.qk_norm) {
        w.q_norm = norm(p + "self_attn.q_norm", hd);
        w.k_norm = norm(p + "self_attn.k_norm", hd);
      }
    }
    l.post_attn_norm = norm(p + "post_attention_layernorm", h);
    if (l.moe) {
      const int64_t inter = o.moe_intermediate_size;
      l.router = add(p + "mlp.gate.weight", {o.num_experts, h}, true, true, false);
      if (o.correction_bias) {
        l.correction_bias = at::zeros({o.num_experts}, at::TensorOptions(runtime_.dense_device));
        buffers_.push_back({p + "mlp.gate.e_score_correction_bias", l.correction_bias,
                            /*weight_decay=*/false, /*expert=*/false});
      }
      l.gate_up_proj =
          add(p + "mlp.experts.gate_up_proj", {o.num_experts, 2 * inter, h}, true, true, true);
      l.gate_up_scale = std::exchange(fp8_scale, {});
      l.gate_up_zero_point = std::exchange(int4_zero_point, {});
      l.down_proj = add(p + "mlp.experts.down_proj", {o.num_experts, h, inter}, true, true, true);
      l.down_scale = std::exchange(fp8_scale, {});
      l.down_zero_point = std::exchange(int4_zero_point, {});
      if (runtime_.expert_master_weights) {
        l.gate_up_compute = at::empty_like(l.gate_up_proj, runtime_.expert_dtype);
        l.down_compute = at::empty_like(l.down_proj, runtime_.expert_dtype);
      }
      if (o.shared_expert_intermediate_size > 0) {
        swiglu(p + "mlp.shared_expert", o.shared_expert_intermediate_size, l);
        l.shared_gate = linear(p + "mlp.shared_expert_gate", 1, h);
      } else if (o.n_shared_experts > 0) {
        swiglu(p + "mlp.shared_experts", o.shared_experts_intermediate_size(), l);
      }
    } else {
      swiglu(p + "mlp", o.intermediate_size, l);
    }
    layers_.push_back(std::move(l));
  }
  final_norm_ = norm("model.norm", h);
  lm_head_ = o.tie_word_embeddings ? embed_tokens_ : linear("lm_head", o.vocab_size, h);
}

std::vector<Parameter> MoeModel::named_tensors() const {
  std::vector<Parameter> out = params_;
  out.insert(out.end(), buffers_.begin(), buffers_.end());
  return out;
}

int64_t MoeModel::expert_pack_bytes() const { return backend_->kept_pack_bytes(); }

std::vector<MoeModel::LinearSlot> MoeModel::LinearSlots() {
  std::vector<LinearSlot> slots;
  for (Layer& l : layers_) {
    const std::string p = absl::StrCat("model.layers.", l.idx, ".");
    auto add = [&](const std::string& name, at::Tensor& w, LoraAdapter& a) {
      if (w.defined()) slots.push_back({p + name, &w, &a});
    };
    if (options_.attention == AttentionKind::kMla) {
      LatentWeights& w = l.mla;
      add("self_attn.q_a_proj", w.q_a_proj, w.q_a_lora);
      add("self_attn.q_b_proj", w.q_b_proj, w.q_b_lora);
      add("self_attn.q_proj", w.q_proj, w.q_lora);
      add("self_attn.kv_a_proj_with_mqa", w.kv_a_proj, w.kv_a_lora);
      add("self_attn.kv_b_proj", w.kv_b_proj, w.kv_b_lora);
      add("self_attn.o_proj", w.o_proj, w.o_lora);
    } else {
      GqaWeights& w = l.gqa;
      add("self_attn.q_proj", w.q_proj, w.q_lora);
      add("self_attn.k_proj", w.k_proj, w.k_lora);
      add("self_attn.v_proj", w.v_proj, w.v_lora);
      add("self_attn.o_proj", w.o_proj, w.o_lora);
    }
    add(l.mlp_name + ".gate_proj", l.mlp.gate, l.mlp.gate_lora);
    add(l.mlp_name + ".up_proj", l.mlp.up, l.mlp.up_lora);
    add(l.mlp_name + ".down_proj", l.mlp.down, l.mlp.down_lora);
    add("mlp.shared_expert_gate", l.shared_gate, l.shared_gate_lora);
  }
  if (!options_.tie_word_embeddings) slots.push_back({"lm_head", &lm_head_, &lm_head_lora_});
  return slots;
}

void MoeModel::AddAdapters(uint64_t seed) {
  const LoraOptions& lo = runtime_.lora;
  const int64_t r = lo.rank;
  const double scaling = lo.scaling();
  // Each adapter's A from its own generator (by module, and by global expert):
  // the same values at any expert-parallel degree.
  uint64_t what = 0;
  auto make = [&](const std::string& name, std::vector<int64_t> shape, c10::Device device,
                  bool expert) {
    at::Tensor t = at::zeros(shape, at::TensorOptions().dtype(at::kFloat).device(device));
    t.requires_grad_(true);
    adapters_.push_back({name, t, /*weight_decay=*/true, expert});
    return t;
  };
  for (const LinearSlot& slot : LinearSlots()) {
    ++what;
    if (!lora_targets_.modules.contains(slot.name)) continue;
    const at::Tensor& w = *slot.weight;
    LoraAdapter& a = *slot.adapter;
    a.a = make(slot.name + ".lora_A.weight", {r, w.size(1)}, w.device(), false);
    a.b = make(slot.name + ".lora_B.weight", {w.size(0), r}, w.device(), false);
    a.scaling = scaling;
    at::Tensor a_cpu = at::empty({r, w.size(1)});
    DrawLoraA(a_cpu, MixSeed(seed, what));
    torch::NoGradGuard no_grad;
    a.a.copy_(a_cpu);
  }
  const int64_t first = placement_.first_expert(runtime_.expert_group->rank());
  const int64_t h = options_.hidden_size, inter = options_.moe_intermediate_size;
  for (Layer& l : layers_) {
    if (!l.moe) continue;
    const std::string p = absl::StrCat("model.layers.", l.idx, ".mlp.experts.");
    const int64_t local = l.gate_up_proj.size(0);
    experts::ExpertLora& el = l.expert_lora;
    el.scaling = scaling;
    auto pair = [&](const std::string& proj, int64_t in, int64_t out, at::Tensor& a, at::Tensor& b,
                    uint64_t kind) {
      a = make(p + proj + ".lora_A", {local, r, in}, c10::kCPU, true);
      b = make(p + proj + ".lora_B", {local, out, r}, c10::kCPU, true);
      torch::NoGradGuard no_grad;
      for (int64_t e = 0; e < local; ++e) {
        DrawLoraA(a[e], MixSeed(seed, (1ULL << 40) + (static_cast<uint64_t>(l.idx) << 20) +
                                          2 * static_cast<uint64_t>(first + e) + kind));
      }
    };
    if (lora_targets_.expert_gate_up) {
      pair("gate_up_proj", h, 2 * inter, el.gate_up_a, el.gate_up_b, 0);
    }
    if (lora_targets_.expert_down) pair("down_proj", inter, h, el.down_a, el.down_b, 1);
  }
}

void MoeModel::SyncExpertCopies() {
  torch::NoGradGuard no_grad;
  for (Layer& l : layers_) {
    if (!l.gate_up_compute.defined()) continue;
    l.gate_up_compute.copy_(l.gate_up_proj);
    l.down_compute.copy_(l.down_proj);
  }
}

std::vector<MoeModel::MasterCopy> MoeModel::expert_master_copies() const {
  std::vector<MasterCopy> out;
  const int64_t first = placement_.first_expert(runtime_.expert_group->rank());
  for (const Layer& l : layers_) {
    if (!l.gate_up_compute.defined()) continue;
    const std::string p = absl::StrCat("model.layers.", l.idx, ".mlp.experts.");
    out.push_back(
        {p + "gate_up_proj", l.gate_up_proj, l.gate_up_compute, first * l.gate_up_proj[0].numel()});
    out.push_back({p + "down_proj", l.down_proj, l.down_compute, first * l.down_proj[0].numel()});
  }
  return out;
}

std::vector<at::Tensor> MoeModel::expert_copies() const {
  std::vector<at::Tensor> out;
  for (const Layer& l : layers_) {
    if (l.gate_up_compute.defined()) out.insert(out.end(), {l.gate_up_compute, l.down_compute});
  }
  return out;
}

void MoeModel::SetCachedExperts(int64_t layer_idx, std::vector<int64_t> local_experts) {
  TORCH_CHECK(runtime_.expert_cache_device.has_value(), "no hot-expert cache in this model");
  TORCH_CHECK(
      layer_idx >= 0 && layer_idx < static_cast<int64_t>(layers_.size()) && layers_[layer_idx].moe,
      "layer ", layer_idx, " is not a MoE layer");
  const Layer& l = layers_[layer_idx];
  experts::ExpertWeights host{l.gate_up_compute.defined() ? l.gate_up_compute : l.gate_up_proj,
                              l.gate_up_compute.defined() ? l.down_compute : l.down_proj,
                              l.expert_lora};
  const bool frozen = runtime_.lora.enabled() || runtime_.frozen_base;
  expert_caches_[layer_idx].SetExperts(std::move(local_experts), host,
                                       *runtime_.expert_cache_device, frozen);
}

const std::vector<int64_t>& MoeModel::cached_experts(int64_t layer_idx) const {
  return expert_caches_[layer_idx].experts();
}

MoeModel::ExpertRows MoeModel::TakeExpertRows() {
  ExpertRows rows = expert_rows_;
  expert_rows_ = {};
  return rows;
}

void MoeModel::SetTraining(bool training) {
  for (const LinearSlot& slot : LinearSlots()) {
    slot.adapter->dropout = training ? runtime_.lora.dropout : 0.0;
  }
}

absl::Status MoeModel::MergeAdapters() {
  if (runtime_.quantized_experts()) {
    return absl::FailedPreconditionError(
        "adapters are folded into bfloat16 or float32 experts, not FP8 or int4 ones: build the "
        "model with experts.dtype bfloat16 (or lora.base_dtype) to merge");
  }
  torch::NoGradGuard no_grad;
  auto fold = [](at::Tensor w, const at::Tensor& a, const at::Tensor& b, double scaling) {
    w.copy_(w.to(at::kFloat)
                .addmm_(b.to(w.device(), at::kFloat), a.to(w.device(), at::kFloat),
                        /*beta=*/1, /*alpha=*/scaling));
    b.zero_();
  };
  for (const LinearSlot& slot : LinearSlots()) {
    const LoraAdapter& a = *slot.adapter;
    if (a.defined()) fold(*slot.weight, a.a, a.b, a.scaling);
  }
  for (Layer& l : layers_) {
    const experts::ExpertLora& el = l.expert_lora;
    for (int64_t e = 0; l.moe && e < l.gate_up_proj.size(0); ++e) {
      if (el.gate_up_a.defined())
        fold(l.gate_up_proj[e], el.gate_up_a[e], el.gate_up_b[e], el.scaling);
      if (el.down_a.defined()) fold(l.down_proj[e], el.down_a[e], el.down_b[e], el.scaling);
    }
  }
  return absl::OkStatus();
}

at::Tensor MoeModel::Moe(const Layer& l, const at::Tensor& x, int64_t num_sequences,
                         MoeLayerRouting* routing) {
  const ModelOptions& o = options_;
  const int64_t k = o.num_experts_per_tok;
  // a. Router on the dense device.
  at::Tensor logits = at::linear(x, l.router);
  router::TopKRouting r;
  if (o.scoring == RouterScoring::kSigmoid) {
    r = router::SigmoidGroupTopK(logits, l.correction_bias,
                                 {.num_experts_per_tok = k,
                                  .n_group = o.n_group,
                                  .topk_group = o.topk_group,
                                  .norm_topk_prob = o.norm_topk_prob,
                                  .routed_scaling_factor = o.routed_scaling_factor});
    if (o.aux_loss_alpha > 0) {
      routing->seq_balance_sum = router::SequenceBalanceLossSum(r.probs, r.topk_idx, num_sequences);
    }
  } else {
    r = router::SoftmaxTopK(logits, {.num_experts_per_tok = k, .norm_topk_prob = o.norm_topk_prob});
  }
  router::BalanceStats stats = router::ComputeBalanceStats(r, o.num_experts);
  routing->layer_idx = l.idx;
  routing->prob_sum = stats.prob_sum;
  routing->expert_count = stats.expert_count.to(at::kCPU);
  routing->correction_bias = l.correction_bias;
  if (runtime_.routing_telemetry) routing->entropy_sum = router::RouterEntropySum(r.probs).cpu();

  // c. Activations to the host, in the experts' dtype (converted first: fewer bytes cross).
  at::Tensor x_host = internal::MoveActivations(x.to(runtime_.expert_compute_dtype()), at::kCPU);
  // The shared expert, queued now: on a GPU it runs while the host computes the routed experts.
  at::Tensor shared;
  if (l.shared_gate.defined()) {
    shared = at::sigmoid(Linear(x, l.shared_gate, {}, l.shared_gate_lora)) * SwiGlu(x, l.mlp);
  } else if (l.mlp.gate.defined()) {
    shared = SwiGlu(x, l.mlp);
  }
  // d-g. Remap and dispatch each (token, slot) row to the owner of its expert,
  // compute this rank's experts (with their adapters under LoRA), and combine:
  // each token's routing-weighted sum over its experts comes home. In
  // runtime_.dispatch_chunks chunks of tokens, pipelined.
  const parallel::ScopedLayer layer_progress(l.idx);  // named by a watchdog report
  experts::ExpertWeights weights{
      l.gate_up_proj, l.down_proj,          l.expert_lora,     l.gate_up_scale,
      l.down_scale,   l.gate_up_zero_point, l.down_zero_point, runtime_.int4_group_size};
  experts::ExpertFfnOptions ffn{.recompute = runtime_.recompute == Recompute::kExperts};
  if (l.gate_up_compute.defined()) {
    ffn.gate_up_master = l.gate_up_proj;
    ffn.down_master = l.down_proj;
    weights.gate_up_proj = l.gate_up_compute;
    weights.down_proj = l.down_compute;
  }
  const LayerExpertCache& cache = expert_caches_[l.idx];
  auto compute = [&](const parallel::DispatchedRows& rows) {
    for (int64_t c : rows.counts) expert_rows_.total += c;
    if (cache_backend_ != nullptr && !cache.empty()) {
      // The cached experts' rows on the cache's device, the others here.
      return cache.Compute(*backend_, *cache_backend_, rows.rows, rows.row_index, rows.counts,
                           weights, ffn, &expert_rows_.cached);
    }
    experts::ExpertFfnOptions chunk_ffn = ffn;
    chunk_ffn.row_index = rows.row_index;
    chunk_ffn.row_copies = rows.row_copies;
    return experts::ExpertFfn(*backend_, rows.rows, rows.counts, weights, chunk_ffn);
  };
  routing->topk_idx = r.topk_idx.to(at::kCPU);
  at::Tensor out = dispatcher_
                       ->Run(x_host, routing->topk_idx, r.topk_weight.to(at::kCPU, at::kFloat),
                             runtime_.dispatch_chunks, compute)
                       .to(x.scalar_type());
  out = internal::MoveActivations(out, x.device());  // back to the dense device
  return shared.defined() ? out + shared : out;
}

at::Tensor MoeModel::DecoderLayer(const Layer& l, const at::Tensor& hidden_in,
                                  const RotaryTables& rope, const at::Tensor& segments,
                                  MoeLayerRouting* routing) {
  const ModelOptions& o = options_;
  const int64_t b = hidden_in.size(0), t = hidden_in.size(1);
  at::Tensor normed = RmsNorm(hidden_in, l.input_norm, o.rms_norm_eps);
  at::Tensor hidden = hidden_in + (o.attention == AttentionKind::kMla
                                       ? LatentAttention(o, l.mla, normed, rope, segments)
                                       : GqaAttention(o, l.gqa, normed, rope, segments));
  normed = RmsNorm(hidden, l.post_attn_norm, o.rms_norm_eps);
  if (!l.moe) return hidden + SwiGlu(normed, l.mlp);
  at::Tensor flat = normed.reshape({b * t, o.hidden_size});
  return hidden + Moe(l, flat, b, routing).view({b, t, o.hidden_size});
}

ForwardResult MoeModel::Forward(const at::Tensor& input_ids, const at::Tensor& position_ids,
                                const at::Tensor& segment_ids) {
  const ModelOptions& o = options_;
  const c10::Device dev = runtime_.dense_device;
  at::Tensor ids = input_ids.to(dev);
  const int64_t b = ids.size(0), t = ids.size(1);
  ForwardResult result;
  // Segments and gathered rotary tables only where a batch needs them: the
  // byte stream (one segment per row, positions 0..T-1) keeps plain causal
  // attention and the shared [T, rotary_dim] tables. Routing is per token and
  // needs neither.
  at::Tensor segments;
  if (segment_ids.defined() && t > 1 &&
      segment_ids.narrow(1, 1, t - 1).ne(segment_ids.narrow(1, 0, t - 1)).any().item<bool>()) {
    segments = segment_ids.to(dev);
  }
  const bool plain_positions =
      !position_ids.defined() ||
      at::equal(position_ids.to(at::kCPU, at::kLong), at::arange(t, at::kLong).expand({b, t}));
  const RotaryTables rope =
      plain_positions ? ComputeRotaryTables(o, t, dev) : ComputeRotaryTables(o, position_ids, dev);

  // A narrow frozen embedding gives float32 activations all the same.
  at::Tensor hidden = at::embedding(embed_tokens_, ids).to(at::kFloat);
  const bool recompute = runtime_.recompute == Recompute::kFull && at::GradMode::is_enabled();
  for (const Layer& l : layers_) {
    MoeLayerRouting routing;
    if (recompute) {
      // The layer runs again in the backward pass (after Forward returns), so
      // the function owns what it uses; the routing statistics are taken from
      // the first run and the differentiable ones come back as outputs.
      auto first = std::make_shared<MoeLayerRouting>();
      auto seen = std::make_shared<bool>(false);
      const Layer* layer = &l;
      auto fn = [this, layer, rope, segments, first, seen](const std::vector<at::Tensor>& in) {
        MoeLayerRouting r;
        at::Tensor out = DecoderLayer(*layer, in[0], rope, segments, &r);
        if (!*seen) {
          *first = r;
          *seen = true;
        }
        return std::vector<at::Tensor>{out, r.prob_sum, r.seq_balance_sum};
      };
      std::vector<at::Tensor> outs = Recomputed(fn, {hidden});
      hidden = outs[0];
      routing = *first;
      routing.prob_sum = outs[1];
      routing.seq_balance_sum = outs[2];
    } else {
      hidden = DecoderLayer(l, hidden, rope, segments, &routing);
    }
    if (l.moe) result.moe_layers.push_back(std::move(routing));
  }
  result.logits = Linear(RmsNorm(hidden, final_norm_, o.rms_norm_eps), lm_head_, {}, lm_head_lora_)
                      .to(at::kFloat);
  return result;
}

LossSum CausalLmLossSum(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t t = logits.size(1);
  at::Tensor shift_logits = logits.narrow(1, 0, t - 1).reshape({-1, logits.size(2)});
  at::Tensor shift_labels = labels.to(logits.device()).narrow(1, 1, t - 1).reshape({-1});
  LossSum out;
  out.sum = at::cross_entropy_loss(shift_logits, shift_labels, /*weight=*/{}, at::Reduction::Sum,
                                   /*ignore_index=*/-100);
  out.num_tokens = CountTrainedTokens(labels);
  return out;
}

int64_t CountTrainedTokens(const at::Tensor& labels) {
  return labels.narrow(1, 1, labels.size(1) - 1).ne(-100).sum().item<int64_t>();
}

}  // namespace moefit::framework
