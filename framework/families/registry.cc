// Every model family is listed here, once.
#include "framework/families/family.h"
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

const ModelFamily* FindModelFamily(std::string_view model_type) {
  for (const ModelFamily& f : ModelFamilies()) {
    if (f.name == model_type) return &f;
  }
  return nullptr;
}

}  // namespace moefit::framework
