// qwen2_moe (Qwen1.5-MoE, Qwen2-57B-A14B): q/k/v biases, no q/k norm, and a
// shared expert whose output is scaled by sigmoid(shared_expert_gate(x)).
// Defaults are those of HF Qwen2MoeConfig.
#include "framework/families/qwen2_moe.h"

#include <nlohmann/json.hpp>

namespace moefit::framework {

ModelFamily Qwen2MoeFamily() {
  return {"qwen2_moe", "Qwen2MoeForCausalLM", [](ModelOptions& o) {
            o.qk_norm = false;
            o.attention_bias = true;
            o.rope_theta = 10000.0;
            o.rms_norm_eps = 1e-6;
            o.norm_topk_prob = false;
            o.router_aux_loss_coef = 0.001;
            o.decoder_sparse_step = 1;
            o.tie_word_embeddings = false;
            o.max_position_embeddings = 32768;
            o.initializer_range = 0.02;
          },
          [](nlohmann::json& j) {
            // transformers v5 names the q/k/v biases qkv_bias in this family.
            if (j.contains("qkv_bias")) {
              if (!j.contains("attention_bias")) j["attention_bias"] = j["qkv_bias"];
              j.erase("qkv_bias");
            }
          },
          [](const ModelOptions& o, nlohmann::json& j) {
            QwenMoeToHfConfig(o, j);
            j["shared_expert_intermediate_size"] = o.shared_expert_intermediate_size;
            j["qkv_bias"] = o.attention_bias;
          }};
}

}  // namespace moefit::framework
