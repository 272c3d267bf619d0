// Tensor shapes in messages, as "[2, 3]" (internal; for the files that see
// LibTorch).
#pragma once

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moefit::checkpoint::internal {

inline std::string ShapeString(c10::ArrayRef<int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace moefit::checkpoint::internal
