// The mixtral family; see mixtral.cc and family.h.
#pragma once

#include "framework/families/family.h"

namespace moefit::framework {

ModelFamily MixtralFamily();

}  // namespace moefit::framework
