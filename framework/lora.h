// LoRA: low-rank adapters on a frozen base, and linear layers over frozen
// weights kept in a narrower dtype than the activations.
//
// A LoRA adapter on a linear layer W [out, in] adds x·Aᵀ·Bᵀ·scaling with A
// [r, in] (drawn as PEFT draws it) and B [out, r] (zeros), so that a new
// adapter leaves the model's outputs unchanged. The routed experts get one
// adapter per expert on the fused gate|up rows and one on down_proj, computed
// as (X·Aᵀ)·Bᵀ inside the expert backend (experts/expert_backend.h); the dense
// linear layers get theirs here. Targets are named as PEFT names them: an
// entry of target_modules matches every linear module whose full name is the
// entry or ends with "." + entry (so "q_proj" is every layer's q_proj,
// "shared_experts.gate_proj" only the shared experts'); "all-linear" is every
// dense linear layer but the LM head. The routed experts are parameters of one
// fused module in transformers, targeted as "experts.gate_up_proj",
// "experts.down_proj" or "experts" (both) and saved through PEFT's
// target_parameters.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "framework/model_options.h"

namespace moefit::framework {

struct LoraOptions {
  int64_t rank = 0;  // 0: no adapters (full fine-tuning)
  double alpha = 16;
  // Dropout on the adapters' input (dense targets only: PEFT has none for the
  // fused experts either), in training only.
  double dropout = 0;
  bool use_rslora = false;  // scaling alpha / sqrt(r) instead of alpha / r
  std::vector<std::string> target_modules;

  bool enabled() const { return rank > 0; }
  double scaling() const;
};

// An adapter on one linear layer: y += dropout(x)·aᵀ·bᵀ·scaling. Undefined `a`: none.
struct LoraAdapter {
  at::Tensor a;  // [r, in]
  at::Tensor b;  // [out, r]
  double scaling = 0;
  double dropout = 0;  // in effect now: the model's, in training only (MoeModel::SetTraining)
  bool defined() const { return a.defined(); }
};

// x·weightᵀ + bias, plus the adapter when it is defined. A weight whose dtype
// differs from x's (a frozen bfloat16 base under float32 activations) is
// upcast for this one product, in the forward and again in the backward, so it
// is never held upcast; such a weight must not require grad. Under autocast of
// x's device (train.dense_dtype = bfloat16) LibTorch casts x and the weights
// instead: a trained float32 weight takes bfloat16 activations, and its
// gradient is float32.
at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {},
                  const LoraAdapter& adapter = {});

// One dense linear module LoRA can target, with its HF name (no ".weight").
struct LinearModule {
  std::string name;  // e.g. model.layers.0.self_attn.q_proj
  int64_t in = 0, out = 0;
  bool lm_head = false;  // left out of "all-linear", as PEFT does
};
// Every dense linear module of the model these options describe, in the
// model's order: attention projections, dense MLPs, shared experts and their
// gate, and the LM head when it is not tied to the embedding. The routers are
// not linear modules in transformers and cannot be targeted.
std::vector<LinearModule> LinearModules(const ModelOptions& options);

// What target_modules selects in a model.
struct LoraTargets {
  std::set<std::string> modules;  // full names of the targeted dense modules
  bool expert_gate_up = false;    // routed experts' gate_up_proj
  bool expert_down = false;       // routed experts' down_proj

  bool experts() const { return expert_gate_up || expert_down; }
};
// InvalidArgument naming the entry when one matches nothing, and for an empty list.
absl::StatusOr<LoraTargets> ResolveLoraTargets(const ModelOptions& options,
                                               const std::vector<std::string>& target_modules);

// Adapter parameters of the whole model (every expert), as PEFT counts them.
int64_t CountLoraParameters(const ModelOptions& options, const LoraTargets& targets, int64_t rank);

}  // namespace moefit::framework
