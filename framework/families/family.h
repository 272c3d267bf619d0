// Model families: what differs between qwen3_moe, qwen2_moe, mixtral, ...
//
// A family is one file here (its traits and the HF defaults of the fields a
// config.json may leave out) plus, later, one converter mapping table in
// checkpoint/. The decoder itself is shared: families differ in a few switches,
// as in llama.cpp's one-file-per-architecture layout. Families are listed
// explicitly in registry.cc.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <string_view>
#include <vector>

#include "framework/model_options.h"

namespace moefit::framework {

struct ModelFamily {
  std::string name;          // HF model_type
  std::string architecture;  // HF architectures[0], e.g. Qwen3MoeForCausalLM
  // Sets this family's HF defaults and fixed traits (qk_norm, ...) on a fresh
  // ModelOptions; the fields a config gives are applied on top afterwards.
  void (*set_defaults)(ModelOptions& options);
  // Renames this family's config.json keys to the shared ones (ModelOptions'
  // names) in place; keys already present win. nullptr: the names are shared.
  void (*from_hf_config)(nlohmann::json& config) = nullptr;
  // Writes the family-specific keys of config.json (the shared ones are
  // written by framework/hf_io.cc).
  void (*to_hf_config)(const ModelOptions& options, nlohmann::json& config) = nullptr;
  // Other model_type names of the same architecture (kimi_k2 for deepseek_v3).
  std::vector<std::string> aliases = {};
};

// The shared part of a DeepSeek-style MoE config.json (deepseek_v3, glm4_moe):
// n_routed_experts, shared experts, dense first layers, sigmoid routing.
void DeepseekMoeFromHfConfig(nlohmann::json& config);
void DeepseekMoeToHfConfig(const ModelOptions& options, nlohmann::json& config);

// The shared part of a Qwen-MoE config.json (qwen2_moe and qwen3_moe).
void QwenMoeToHfConfig(const ModelOptions& options, nlohmann::json& config);

// Every registered family, in registration order.
const std::vector<ModelFamily>& ModelFamilies();
// nullptr when `model_type` is neither a registered name nor an alias.
const ModelFamily* FindModelFamily(std::string_view model_type);

}  // namespace moefit::framework
