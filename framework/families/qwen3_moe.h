// The qwen3_moe family; see qwen3_moe.cc and family.h.
#pragma once

#include "framework/families/family.h"

namespace moefit::framework {

ModelFamily Qwen3MoeFamily();

}  // namespace moefit::framework
