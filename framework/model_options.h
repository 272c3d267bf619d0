// The resolved shape of a MoE decoder: plain values, no protobuf.
//
// launch/ parses the config (text proto, `--set` overrides, an HF config.json)
// once and hands this struct inward. Field names are the HF config.json names.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moefit::framework {

struct ModelOptions {
  std::string model_type;  // family: qwen3_moe, qwen2_moe, mixtral
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP layers
  int64_t moe_intermediate_size = 0;  // routed experts
  int64_t shared_expert_intermediate_size = 0;  // 0 = no shared expert
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  bool norm_topk_prob = false;
  double router_aux_loss_coef = 0.0;
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
  std::vector<int64_t> mlp_only_layers;
  int64_t decoder_sparse_step = 1;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 4096;
  double initializer_range = 0.02;
  bool attention_bias = false;  // q/k/v biases (o_proj never has one)
  bool qk_norm = false;         // per-head RMSNorm of q and k (qwen3_moe)

  // Whether decoder layer `layer_idx` has routed experts (else a dense MLP):
  // the qwen2_moe/qwen3_moe rule, which mixtral's defaults make always true.
  bool IsMoeLayer(int64_t layer_idx) const;
};

}  // namespace moefit::framework
