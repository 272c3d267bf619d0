// Model families: what differs between qwen3_moe, qwen2_moe, mixtral, ...
//
// A family is one file here (its traits and the HF defaults of the fields a
// config.json may leave out) plus, later, one converter mapping table in
// checkpoint/. The decoder itself is shared: families differ in a few switches,
// as in llama.cpp's one-file-per-architecture layout. Families are listed
// explicitly in registry.cc.
#pragma once

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
};

// Every registered family, in registration order.
const std::vector<ModelFamily>& ModelFamilies();
// nullptr when `model_type` is not registered.
const ModelFamily* FindModelFamily(std::string_view model_type);

}  // namespace moefit::framework
