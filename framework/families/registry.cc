// Every model family is listed here, once.
#include "framework/families/family.h"

#include <nlohmann/json.hpp>

#include "framework/families/deepseek_v3.h"
#include "framework/families/glm4_moe.h"
#include "framework/families/mixtral.h"
#include "framework/families/qwen2_moe.h"
#include "framework/families/qwen3_moe.h"

namespace moefit::framework {

const std::vector<ModelFamily>& ModelFamilies() {
  static const std::vector<ModelFamily> families = {
      Qwen3MoeFamily(),
      Qwen2MoeFamily(),
      MixtralFamily(),
      DeepseekV3Family(),
      Glm4MoeFamily(),
  };
  return families;
}

void QwenMoeToHfConfig(const ModelOptions& o, nlohmann::json& j) {
  j["num_experts"] = o.num_experts;
  j["intermediate_size"] = o.intermediate_size;
  j["moe_intermediate_size"] = o.moe_intermediate_size;
  j["norm_topk_prob"] = o.norm_topk_prob;
  j["mlp_only_layers"] = o.mlp_only_layers;
  j["decoder_sparse_step"] = o.decoder_sparse_step;
  j["attention_bias"] = o.attention_bias;
}

void DeepseekMoeFromHfConfig(nlohmann::json& j) {
  if (j.contains("n_routed_experts")) {
    if (!j.contains("num_experts")) j["num_experts"] = j["n_routed_experts"];
    j.erase("n_routed_experts");
  }
}

void DeepseekMoeToHfConfig(const ModelOptions& o, nlohmann::json& j) {
  j.erase("num_experts");
  j["n_routed_experts"] = o.num_experts;
  j["n_shared_experts"] = o.n_shared_experts;
  j["intermediate_size"] = o.intermediate_size;
  j["moe_intermediate_size"] = o.moe_intermediate_size;
  j["n_group"] = o.n_group;
  j["topk_group"] = o.topk_group;
  j["norm_topk_prob"] = o.norm_topk_prob;
  j["routed_scaling_factor"] = o.routed_scaling_factor;
  j["first_k_dense_replace"] = o.first_k_dense_replace;
  // moefit never holds the multi-token-prediction layers (skipped on load),
  // so the directory it writes has none.
  j["num_nextn_predict_layers"] = 0;
  j.erase("num_mtp_layers");
}

const ModelFamily* FindModelFamily(std::string_view model_type) {
  for (const ModelFamily& f : ModelFamilies()) {
    if (f.name == model_type) return &f;
    for (const std::string& alias : f.aliases) {
      if (alias == model_type) return &f;
    }
  }
  return nullptr;
}

}  // namespace moefit::framework
