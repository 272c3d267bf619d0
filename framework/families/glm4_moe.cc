// glm4_moe (GLM-4.5 355B, GLM-4.5-Air): GQA attention with rotary on half of
// each head (partial_rotary_factor 0.5), q/k/v biases and per-head q/k norm as
// the config says, DeepSeek-style sigmoid routing with a correction bias,
// ungated shared experts and dense first layers. Defaults are those of HF
// Glm4MoeConfig.
#include "framework/families/glm4_moe.h"

#include <nlohmann/json.hpp>

namespace moefit::framework {

ModelFamily Glm4MoeFamily() {
  return {"glm4_moe", "Glm4MoeForCausalLM",
          [](ModelOptions& o) {
            o.attention = AttentionKind::kGqa;
            o.partial_rotary_factor = 0.5;
            o.qk_norm = false;
            o.attention_bias = false;
            o.rope_theta = 10000.0;
            o.rms_norm_eps = 1e-5;
            o.scoring = RouterScoring::kSigmoid;
            o.correction_bias = true;
            o.n_group = 1;
            o.topk_group = 1;
            o.norm_topk_prob = true;
            o.routed_scaling_factor = 1.0;
            o.n_shared_experts = 1;
            o.first_k_dense_replace = 1;
            o.router_aux_loss_coef = 0.0;
            o.tie_word_embeddings = false;
            o.max_position_embeddings = 131072;
            o.initializer_range = 0.02;
          },
          &DeepseekMoeFromHfConfig,
          [](const ModelOptions& o, nlohmann::json& j) {
            DeepseekMoeToHfConfig(o, j);
            j["attention_bias"] = o.attention_bias;
            j["use_qk_norm"] = o.qk_norm;
            j["partial_rotary_factor"] = o.partial_rotary_factor;
          }};
}

}  // namespace moefit::framework
