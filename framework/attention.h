// Attention variants of the decoder and the rotary tables they share.
//
// Free functions over plain weight structs, so that the model file stays a
// wiring of blocks and the tests can drive each variant alone (in double
// precision for the finite-difference gradient checks). Numerics follow HF
// transformers op for op: GQA as Qwen3MoeAttention / Glm4MoeAttention (partial
// rotary), multi-head latent attention as DeepseekV3Attention, rotary
// frequencies as modeling_rope_utils (default and YaRN).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "framework/lora.h"
#include "framework/model_options.h"

namespace moefit::framework {

// Rotary tables for positions [0, num_positions): cos and sin [T, rotary_dim]
// (frequencies repeated twice, as HF's cat(freqs, freqs)), already multiplied
// by the YaRN attention factor; and the softmax scale of attention (DeepSeek's
// YaRN mscale correction included).
struct RotaryTables {
  at::Tensor cos, sin;
  double softmax_scale = 1.0;
};
RotaryTables ComputeRotaryTables(const ModelOptions& options, int64_t num_positions,
                                 c10::Device device);
// The same rows gathered per token, for packed sequences whose positions
// restart at every sample: position_ids [B, T] int64 -> cos and sin
// [B, 1, T, rotary_dim] (broadcasting over the heads).
RotaryTables ComputeRotaryTables(const ModelOptions& options, const at::Tensor& position_ids,
                                 c10::Device device);

// Attention mask of packed sequences: segment_ids [B, T] -> [B, 1, T, T] bool,
// true where query i may attend to key j (j <= i and the same segment): causal
// and block-diagonal, so that no token sees another sample.
at::Tensor SegmentCausalMask(const at::Tensor& segment_ids);

// RMSNorm computed in at least fp32, the result in x's dtype times weight.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

struct GqaWeights {
  at::Tensor q_proj, k_proj, v_proj, o_proj;
  at::Tensor q_bias, k_bias, v_bias;  // defined when attention_bias
  at::Tensor q_norm, k_norm;          // defined when qk_norm
  LoraAdapter q_lora, k_lora, v_lora, o_lora;  // LoRA fine-tuning: the projections' adapters
};

// x: [B, T, H] -> [B, T, H]. Causal; with `segment_ids` ([B, T], packed
// sequences: 0, 1, ... for the consecutive segments of each row) also within
// segments only (SegmentCausalMask).
at::Tensor GqaAttention(const ModelOptions& options, const GqaWeights& w, const at::Tensor& x,
                        const RotaryTables& rope, const at::Tensor& segment_ids = {});

struct LatentWeights {
  at::Tensor q_proj;                        // without q_lora_rank
  at::Tensor q_a_proj, q_a_norm, q_b_proj;  // with q_lora_rank
  at::Tensor kv_a_proj, kv_a_norm, kv_b_proj, o_proj;
  LoraAdapter q_lora, q_a_lora, q_b_lora, kv_a_lora, kv_b_lora, o_lora;  // LoRA fine-tuning
};

// Multi-head latent attention. x: [B, T, H] -> [B, T, H]; masked as
// GqaAttention.
at::Tensor LatentAttention(const ModelOptions& options, const LatentWeights& w, const at::Tensor& x,
                           const RotaryTables& rope, const at::Tensor& segment_ids = {});

}  // namespace moefit::framework
