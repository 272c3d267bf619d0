// LoRA adapters and linear layers over frozen weights; see lora.h.
#include "framework/lora.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "framework/cpu_linear.h"

namespace moefit::framework {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// y = x·wᵀ + bias with w (and bias) in another dtype than x, frozen. Only the
// narrow weight is saved; the backward upcasts it again for dx.
class UpcastLinear : public torch::autograd::Function<UpcastLinear> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    ctx->save_for_backward({weight});
    return at::linear(x, weight.to(x.scalar_type()));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor weight = ctx->get_saved_variables()[0];
    const at::Tensor& dy = grad_outputs[0];
    return {at::matmul(dy, weight.to(dy.scalar_type())), at::Tensor()};
  }
};

// PEFT's list form: the full name is the entry or ends with "." + entry.
bool SuffixMatch(const std::string& name, const std::string& entry) {
  return name == entry || (name.size() > entry.size() && name.ends_with(entry) &&
                           name[name.size() - entry.size() - 1] == '.');
}

}  // namespace

double LoraOptions::scaling() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank))
                    : alpha / static_cast<double>(rank);
}

at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                  const LoraAdapter& adapter) {
  at::Tensor y;
  if (at::autocast::is_autocast_enabled(x.device().type())) {
    // Mixed precision (train.dense_dtype): LibTorch casts x and the float32
    // weight to the autocast dtype (the weight once per forward, from its cast
    // cache), and the weight's gradient comes back in float32.
    y = at::linear(x, weight, bias);
  } else if (weight.scalar_type() == x.scalar_type()) {
    y = CpuLinearApplies(x, weight, bias) ? CpuLinear(x, weight, bias)
                                          : at::linear(x, weight, bias);
  } else {
    TORCH_CHECK(!weight.requires_grad(), "a trained weight must have the activations' dtype ",
                x.scalar_type(), ", not ", weight.scalar_type());
    y = UpcastLinear::apply(x, weight);
    if (bias.defined()) y = y + bias.to(x.scalar_type());
  }
  if (!adapter.defined()) return y;
  at::Tensor in = x.to(adapter.a.scalar_type());
  if (adapter.dropout > 0) in = at::dropout(in, adapter.dropout, /*train=*/true);
  // The scaling goes on the thin [.., r] product, and in y's dtype the second
  // product is added to y inside the GEMM (addmm): no pass over [.., out] of
  // its own, forward or backward.
  at::Tensor u = at::linear(in, adapter.a) * adapter.scaling;
  if (u.scalar_type() != y.scalar_type()) return y + at::linear(u, adapter.b).to(y.scalar_type());
  const int64_t rank = u.size(-1), out = y.size(-1);
  return at::addmm(y.reshape({-1, out}), u.reshape({-1, rank}), adapter.b.t()).view(y.sizes());
}

std::vector<LinearModule> LinearModules(const ModelOptions& o) {
  std::vector<LinearModule> out;
  const int64_t h = o.hidden_size;
  for (int64_t i = 0; i < o.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    auto add = [&](const std::string& name, int64_t in, int64_t out_features) {
      out.push_back({p + name, in, out_features, false});
    };
    if (o.attention == AttentionKind::kMla) {
      const int64_t heads = o.num_attention_heads;
      if (o.q_lora_rank > 0) {
        add("self_attn.q_a_proj", h, o.q_lora_rank);
        add("self_attn.q_b_proj", o.q_lora_rank, heads * o.qk_head_dim());
      } else {
        add("self_attn.q_proj", h, heads * o.qk_head_dim());
      }
      add("self_attn.kv_a_proj_with_mqa", h, o.kv_lora_rank + o.qk_rope_head_dim);
      add("self_attn.kv_b_proj", o.kv_lora_rank, heads * (o.qk_nope_head_dim + o.v_head_dim));
      add("self_attn.o_proj", heads * o.v_head_dim, h);
    } else {
      const int64_t q = o.num_attention_heads * o.head_dim, kv = o.num_key_value_heads * o.head_dim;
      add("self_attn.q_proj", h, q);
      add("self_attn.k_proj", h, kv);
      add("self_attn.v_proj", h, kv);
      add("self_attn.o_proj", q, h);
    }
    auto swiglu = [&](const std::string& name, int64_t width) {
      add(name + ".gate_proj", h, width);
      add(name + ".up_proj", h, width);
      add(name + ".down_proj", width, h);
    };
    if (!o.IsMoeLayer(i)) {
      swiglu("mlp", o.intermediate_size);
    } else if (o.shared_expert_intermediate_size > 0) {
      swiglu("mlp.shared_expert", o.shared_expert_intermediate_size);
      add("mlp.shared_expert_gate", h, 1);
    } else if (o.n_shared_experts > 0) {
      swiglu("mlp.shared_experts", o.shared_experts_intermediate_size());
    }
  }
  if (!o.tie_word_embeddings) out.push_back({"lm_head", h, o.vocab_size, true});
  return out;
}

absl::StatusOr<LoraTargets> ResolveLoraTargets(const ModelOptions& o,
                                               const std::vector<std::string>& entries) {
  if (entries.empty()) {
    return absl::InvalidArgumentError(
        "lora.target_modules is empty: name the modules to adapt (e.g. q_proj, v_proj, experts)");
  }
  const std::vector<LinearModule> modules = LinearModules(o);
  // Every MoE layer's fused experts module (one adapter setting for all of them).
  std::vector<std::string> experts_modules;
  for (int64_t i = 0; i < o.num_hidden_layers; ++i) {
    if (o.IsMoeLayer(i))
      experts_modules.push_back(absl::StrCat("model.layers.", i, ".mlp.experts"));
  }
  const std::string experts_module = experts_modules.empty() ? "" : experts_modules.front();
  LoraTargets t;
  for (const std::string& entry : entries) {
    bool matched = false;
    if (entry == "all-linear") {
      for (const LinearModule& m : modules) {
        if (!m.lm_head) t.modules.insert(m.name);
      }
      continue;
    }
    bool dense = false;
    for (const LinearModule& m : modules) {
      if (SuffixMatch(m.name, entry)) {
        t.modules.insert(m.name);
        dense = true;
      }
    }
    matched = dense;
    // The fused experts by a name that says so ("down_proj" alone means the
    // dense modules, as in PEFT's target_modules).
    const bool names_experts = entry.find("experts") != std::string::npos ||
                               entry.find("gate_up_proj") != std::string::npos;
    if (!experts_module.empty() && names_experts && entry.find("layers.") != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "lora.target_modules: '", entry,
          "' names one layer's routed experts; they are adapted "
          "in every MoE layer or none (experts, experts.gate_up_proj, experts.down_proj)"));
    }
    if (!experts_module.empty() && names_experts) {
      const bool whole = SuffixMatch(experts_module, entry);
      if (whole || SuffixMatch(experts_module + ".gate_up_proj", entry)) {
        t.expert_gate_up = matched = true;
      }
      if (whole || SuffixMatch(experts_module + ".down_proj", entry)) {
        t.expert_down = matched = true;
      }
    }
    if (!matched) {
      std::string hint;
      if (o.tie_word_embeddings && entry == "lm_head") {
        hint = " (its LM head is the input embedding, tied: not adapted)";
      }
      if (!experts_module.empty() &&
          (entry == "gate_proj" || entry == "up_proj" || entry == "down_proj")) {
        hint =
            " (the routed experts are one fused module: target them as experts.gate_up_proj, "
            "experts.down_proj or experts)";
      }
      std::vector<std::string> names;
      for (const LinearModule& m : modules) {
        const std::string last = m.name.substr(m.name.rfind('.') + 1);
        if (std::find(names.begin(), names.end(), last) == names.end()) names.push_back(last);
      }
      if (!experts_module.empty()) names.push_back("experts");
      return absl::InvalidArgumentError(
          absl::StrCat("lora.target_modules: '", entry, "' matches no module of this ",
                       o.model_type, " model that LoRA can adapt", hint,
                       "; its modules: ", absl::StrJoin(names, ", "), ", all-linear"));
    }
  }
  return t;
}

int64_t CountLoraParameters(const ModelOptions& o, const LoraTargets& t, int64_t rank) {
  int64_t n = 0;
  for (const LinearModule& m : LinearModules(o)) {
    if (t.modules.contains(m.name)) n += rank * (m.in + m.out);
  }
  const int64_t h = o.hidden_size, inter = o.moe_intermediate_size;
  for (int64_t i = 0; i < o.num_hidden_layers; ++i) {
    if (!o.IsMoeLayer(i)) continue;
    if (t.expert_gate_up) n += o.num_experts * rank * (h + 2 * inter);
    if (t.expert_down) n += o.num_experts * rank * (inter + h);
  }
  return n;
}

}  // namespace moefit::framework
