// Every model family is listed here, once.
#include "framework/families/family.h"

#include <nlohmann/json.hpp>

#include "framework/families/mixtral.h"
#include "framework/families/qwen2_moe.h"
#include "framework/families/qwen3_moe.h"

namespace moefit::framework {

const std::vector<ModelFamily>& ModelFamilies() {
  static const std::vector<ModelFamily> families = {
      Qwen3MoeFamily(),
      Qwen2MoeFamily(),
      MixtralFamily(),
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

const ModelFamily* FindModelFamily(std::string_view model_type) {
  for (const ModelFamily& f : ModelFamilies()) {
    if (f.name == model_type) return &f;
  }
  return nullptr;
}

}  // namespace moefit::framework
