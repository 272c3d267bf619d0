// mixtral (Mixtral-8x7B, 8x22B): every layer sparse, top-k weights always
// renormalized, no biases, no q/k norm, no shared expert.
// Its config.json names the expert count num_local_experts and the expert
// width intermediate_size (mapped here both ways). Defaults are those of HF
// MixtralConfig.
#include "framework/families/mixtral.h"

#include <nlohmann/json.hpp>

namespace moefit::framework {

ModelFamily MixtralFamily() {
  return {"mixtral", "MixtralForCausalLM", [](ModelOptions& o) {
            o.qk_norm = false;
            o.attention_bias = false;
            o.rope_theta = 1e6;
            o.rms_norm_eps = 1e-5;
            o.norm_topk_prob = true;
            o.router_aux_loss_coef = 0.001;
            o.decoder_sparse_step = 1;
            o.tie_word_embeddings = false;
            o.max_position_embeddings = 4096 * 32;
            o.initializer_range = 0.02;
          },
          [](nlohmann::json& j) {
            if (j.contains("num_local_experts") && !j.contains("num_experts")) {
              j["num_experts"] = j["num_local_experts"];
            }
            if (j.contains("intermediate_size") && !j.contains("moe_intermediate_size")) {
              j["moe_intermediate_size"] = j["intermediate_size"];
            }
          },
          [](const ModelOptions& o, nlohmann::json& j) {
            j["num_local_experts"] = o.num_experts;
            j["intermediate_size"] = o.moe_intermediate_size;
          }};
}

}  // namespace moefit::framework
