// The qwen2_moe family; see qwen2_moe.cc and family.h.
#pragma once

#include "framework/families/family.h"

namespace moefit::framework {

ModelFamily Qwen2MoeFamily();

}  // namespace moefit::framework
