// ModelOptions helpers and parameter counts; see model_options.h.
//
// CountParameters mirrors MoeModel::Build tensor by tensor (the model test
// checks the two agree), so `moefit plan` can size a trillion-parameter model
// without allocating it.
#include "framework/model_options.h"

#include <algorithm>

namespace moefit::framework {

bool ModelOptions::IsMoeLayer(int64_t layer_idx) const {
  if (num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer_idx) !=
      mlp_only_layers.end()) {
    return false;
  }
  if (decoder_sparse_step <= 0 || (layer_idx + 1) % decoder_sparse_step != 0) return false;
  if (layer_idx < first_k_dense_replace) return false;
  return moe_layer_freq > 0 && layer_idx % moe_layer_freq == 0;
}

int64_t ModelOptions::rotary_dim() const {
  if (attention == AttentionKind::kMla) return qk_rope_head_dim;
  return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor);
}

ParameterCounts CountParameters(const ModelOptions& o) {
  ParameterCounts c;
  const int64_t h = o.hidden_size;
  int64_t attention = 0;
  if (o.attention == AttentionKind::kMla) {
    const int64_t q_out = o.num_attention_heads * o.qk_head_dim();
    attention +=
        o.q_lora_rank > 0 ? h * o.q_lora_rank + o.q_lora_rank + o.q_lora_rank * q_out : h * q_out;
    attention += h * (o.kv_lora_rank + o.qk_rope_head_dim) + o.kv_lora_rank;
    attention += o.kv_lora_rank * o.num_attention_heads * (o.qk_nope_head_dim + o.v_head_dim);
    attention += o.num_attention_heads * o.v_head_dim * h;
  } else {
    const int64_t q = o.num_attention_heads * o.head_dim, kv = o.num_key_value_heads * o.head_dim;
    attention += h * (q + 2 * kv) + q * h;
    if (o.attention_bias) attention += q + 2 * kv;
    if (o.qk_norm) attention += 2 * o.head_dim;
  }
  const int64_t norms = 2 * h;
  const int64_t dense_mlp = 3 * h * o.intermediate_size;
  c.per_expert = 3 * h * o.moe_intermediate_size;
  int64_t moe_dense_part = o.num_experts * h;  // router
  if (o.shared_expert_intermediate_size > 0) {
    moe_dense_part += 3 * h * o.shared_expert_intermediate_size + h;  // + its sigmoid gate
  }
  moe_dense_part += 3 * h * o.shared_experts_intermediate_size();
  for (int64_t l = 0; l < o.num_hidden_layers; ++l) {
    c.dense += attention + norms;
    if (o.IsMoeLayer(l)) {
      ++c.num_moe_layers;
      c.dense += moe_dense_part;
      c.routed_experts += o.num_experts * c.per_expert;
    } else {
      c.dense += dense_mlp;
    }
  }
  c.embedding = o.vocab_size * h * (o.tie_word_embeddings ? 1 : 2);
  c.dense += c.embedding + h;  // + final norm
  c.total = c.dense + c.routed_experts;
  c.active = c.dense + c.num_moe_layers * o.num_experts_per_tok * c.per_expert;
  return c;
}

}  // namespace moefit::framework
