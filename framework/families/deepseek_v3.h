// The deepseek_v3 family (also Kimi-K2); see deepseek_v3.cc and family.h.
#pragma once

#include "framework/families/family.h"

namespace moefit::framework {

ModelFamily DeepseekV3Family();

}  // namespace moefit::framework
