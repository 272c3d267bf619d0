// deepseek_v3 (DeepSeek-V3/R1 671B, Kimi-K2 1T, whose config.json says
// model_type kimi_k2): multi-head latent attention, sigmoid routing with a
// correction bias and group-limited top-k, ungated shared experts, dense first
// layers, YaRN rotary scaling, FP8 block-scaled release checkpoints.
// Defaults are those of HF DeepseekV3Config.
#include "framework/families/deepseek_v3.h"

#include <nlohmann/json.hpp>

namespace moefit::framework {

ModelFamily DeepseekV3Family() {
  return {"deepseek_v3",
          "DeepseekV3ForCausalLM",
          [](ModelOptions& o) {
            o.attention = AttentionKind::kMla;
            o.q_lora_rank = 1536;
            o.kv_lora_rank = 512;
            o.qk_nope_head_dim = 128;
            o.qk_rope_head_dim = 64;
            o.v_head_dim = 128;
            o.rope_interleave = true;
            o.qk_norm = false;
            o.attention_bias = false;
            o.rope_theta = 10000.0;
            o.rms_norm_eps = 1e-6;
            o.scoring = RouterScoring::kSigmoid;
            o.correction_bias = true;
            o.n_group = 8;
            o.topk_group = 4;
            o.norm_topk_prob = true;
            o.routed_scaling_factor = 2.5;
            o.n_shared_experts = 1;
            o.first_k_dense_replace = 3;
            o.moe_layer_freq = 1;
            o.router_aux_loss_coef = 0.0;
            o.tie_word_embeddings = false;
            o.max_position_embeddings = 4096;
            o.initializer_range = 0.02;
          },
          &DeepseekMoeFromHfConfig,
          [](const ModelOptions& o, nlohmann::json& j) {
            DeepseekMoeToHfConfig(o, j);
            j["q_lora_rank"] = o.q_lora_rank > 0 ? nlohmann::json(o.q_lora_rank) : nlohmann::json();
            j["kv_lora_rank"] = o.kv_lora_rank;
            j["qk_nope_head_dim"] = o.qk_nope_head_dim;
            j["qk_rope_head_dim"] = o.qk_rope_head_dim;
            j["v_head_dim"] = o.v_head_dim;
            j["rope_interleave"] = o.rope_interleave;
            j["moe_layer_freq"] = o.moe_layer_freq;
            j["topk_method"] = o.correction_bias ? "noaux_tc" : "greedy";
            j["scoring_func"] = o.scoring == RouterScoring::kSigmoid ? "sigmoid" : "softmax";
            if (o.aux_loss_alpha > 0) {
              j["aux_loss_alpha"] = o.aux_loss_alpha;
              j["seq_aux"] = true;
            }
          },
          /*aliases=*/{"kimi_k2"}};
}

}  // namespace moefit::framework
