// The resolved shape of a MoE decoder: plain values, no protobuf.
//
// launch/ parses the config (text proto, `--set` overrides, an HF config.json)
// once and hands this struct inward. Field names are the HF config.json names.
//
// Two attention kinds and two router kinds cover the families:
//   * GQA attention (qwen*, mixtral, glm4_moe): q/k/v/o projections, optional
//     biases and per-head q/k RMSNorm, rotary on the first
//     head_dim * partial_rotary_factor dims of each head;
//   * MLA (deepseek_v3, Kimi-K2): queries optionally through a low-rank
//     q_a -> RMSNorm -> q_b path, keys and values from one compressed latent
//     (kv_lora_rank) plus a single rotary key shared by all heads.
//   * softmax router (top-k of a softmax, optional renormalization), or
//     sigmoid router (deepseek_v3, glm4_moe): sigmoid scores, a correction
//     bias that only steers which experts are picked, group-limited top-k,
//     renormalization and a routed scaling factor on the weights.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/compressed_tensors.h"

namespace moefit::framework {

// Rotary embedding frequencies (HF rope_scaling / rope_parameters).
struct RopeScaling {
  // "default" (plain RoPE) or "yarn".
  std::string type = "default";
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  // YaRN attention-scale terms; 0 = not given.
  double mscale = 0.0;
  double mscale_all_dim = 0.0;
  // Multiplies cos and sin; nullopt = derived from factor and the mscales.
  std::optional<double> attention_factor;
  bool truncate = true;
};

enum class AttentionKind { kGqa, kMla };
enum class RouterScoring { kSoftmax, kSigmoid };

struct ModelOptions {
  std::string model_type;  // family: qwen3_moe, qwen2_moe, mixtral, deepseek_v3, glm4_moe
  // config.json's model_type when it names the family by another name
  // (kimi_k2 is deepseek_v3); written back on export. Empty = model_type.
  std::string hf_model_type;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP layers
  int64_t moe_intermediate_size = 0;  // routed experts
  int64_t shared_expert_intermediate_size = 0;  // qwen2_moe: gated shared expert; 0 = none
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  bool norm_topk_prob = false;
  double router_aux_loss_coef = 0.0;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  double rms_norm_eps = 1e-6;
  std::vector<int64_t> mlp_only_layers;
  int64_t decoder_sparse_step = 1;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 4096;
  double initializer_range = 0.02;
  bool attention_bias = false;  // q/k/v biases (o_proj never has one)
  bool qk_norm = false;         // per-head RMSNorm of q and k (qwen3_moe; glm4_moe use_qk_norm)
  // Rotary on the first head_dim * partial_rotary_factor dims (GQA; glm4_moe 0.5).
  double partial_rotary_factor = 1.0;

  // Multi-head latent attention (deepseek_v3).
  AttentionKind attention = AttentionKind::kGqa;
  int64_t q_lora_rank = 0;  // 0 = q_proj without compression (config.json null)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  // The rotary dims of q and k are stored as interleaved pairs (DeepSeek's layout).
  bool rope_interleave = true;

  // Router.
  RouterScoring scoring = RouterScoring::kSoftmax;
  // Sigmoid router: e_score_correction_bias steers the top-k choice only.
  bool correction_bias = false;
  int64_t n_group = 1;     // experts are split into n_group groups ...
  int64_t topk_group = 1;  // ... and only the topk_group best groups are eligible
  double routed_scaling_factor = 1.0;
  // Ungated shared experts of width moe_intermediate_size * n_shared_experts.
  int64_t n_shared_experts = 0;
  // Layers [0, first_k_dense_replace) are dense; then every moe_layer_freq-th layer is MoE.
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  // Sequence-wise balance loss coefficient (DeepSeek-V3's alpha); 0 = off.
  double aux_loss_alpha = 0.0;
  // Multi-token-prediction layers stored after the decoder layers in the
  // checkpoint (index num_hidden_layers, ...): skipped on load.
  int64_t num_nextn_predict_layers = 0;
  // The checkpoint's Linear weights are FP8 (e4m3) with one scale per block
  // of [rows, cols]; nullopt = not quantized.
  std::optional<std::array<int64_t, 2>> fp8_weight_block;
  // What an FP8 weight X's scale is called: X_scale_inv (quantization_config
  // "fp8", DeepSeek-V3's) or X_scale (compressed-tensors' float-quantized).
  std::string fp8_scale_suffix = "_scale_inv";
  // The checkpoint's targeted Linear weights (Kimi-K2-Thinking: the routed
  // experts) are compressed-tensors pack-quantized int4 in this scheme;
  // nullopt = none are.
  std::optional<checkpoint::PackedInt4Format> int4_weights;

  // Whether decoder layer `layer_idx` has routed experts (else a dense MLP):
  // qwen's rule (mlp_only_layers, decoder_sparse_step) and deepseek's
  // (first_k_dense_replace, moe_layer_freq), whose defaults leave each other alone.
  bool IsMoeLayer(int64_t layer_idx) const;
  // Width of the ungated shared expert (0 = none).
  int64_t shared_experts_intermediate_size() const {
    return moe_intermediate_size * n_shared_experts;
  }
  // Per-head width of the query and key (MLA: nope + rope dims; GQA: head_dim).
  int64_t qk_head_dim() const {
    return attention == AttentionKind::kMla ? qk_nope_head_dim + qk_rope_head_dim : head_dim;
  }
  // Number of rotary dims per head.
  int64_t rotary_dim() const;
};

// Parameter counts of the model these options describe (every expert, no
// multi-token-prediction layers, the correction bias buffers not counted), as
// transformers counts model.parameters().
struct ParameterCounts {
  int64_t total = 0;
  int64_t active = 0;          // per token: all but the unpicked routed experts
  int64_t routed_experts = 0;  // all routed experts of all layers
  int64_t embedding = 0;       // input embedding (+ LM head when untied)
  int64_t dense = 0;           // everything but the routed experts (held on every dense device)
  int64_t per_expert = 0;      // one routed expert of one layer
  int64_t num_moe_layers = 0;
};
ParameterCounts CountParameters(const ModelOptions& options);

}  // namespace moefit::framework
