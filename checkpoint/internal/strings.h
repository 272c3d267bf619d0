// Bridge from std::string_view to Abseil's string functions (internal).
//
// Debian's Abseil 20220623 is built with ABSL_OPTION_USE_STD_STRING_VIEW 0, so
// absl::string_view is its own type and a std::string_view argument does not
// convert to absl::StrCat's AlphaNum. The checkpoint API speaks
// std::string_view; messages convert at the call site with AsAbsl.
#pragma once

#include <string_view>

#include "absl/strings/string_view.h"

namespace moefit::checkpoint::internal {

inline absl::string_view AsAbsl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

}  // namespace moefit::checkpoint::internal
