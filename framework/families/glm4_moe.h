// The glm4_moe family; see glm4_moe.cc and family.h.
#pragma once

#include "framework/families/family.h"

namespace moefit::framework {

ModelFamily Glm4MoeFamily();

}  // namespace moefit::framework
