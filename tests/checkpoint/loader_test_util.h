// Helpers shared by the checkpoint loader tests: bytewise tensor equality,
// and a mapping table whose one rule has no fused loading path.
#pragma once

#include <ATen/ATen.h>

#include <cstring>

#include "absl/status/statusor.h"
#include "checkpoint/mapping_table.h"

namespace moefit::checkpoint {

// Same dtype, shape and bytes.
inline bool SameBytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ca = a.contiguous();
  const at::Tensor cb = b.contiguous();
  return std::memcmp(ca.const_data_ptr(), cb.const_data_ptr(), ca.nbytes()) == 0;
}

// "w.weight" transposed into "w_t": a rule the loader runs through the
// reference ops, so a quantized source is widened first.
inline absl::StatusOr<MappingTable> TransposingTable() {
  return ParseMappingTable(R"pb(
                             family: "test"
                             rule {
                               source: "w.weight"
                               target: "w_t"
                               op { transpose { dim0: 0 dim1: 1 } }
                             }
                           )pb",
                           "test.textproto");
}

}  // namespace moefit::checkpoint
