// Executing a mapping rule's operations on tensors (the reference path).
//
// Between operations a rule's tensors are held as groups: one list per source
// pattern, each list holding one tensor per expert until a merge stacks it (or
// a single tensor). ApplyOps is the plain, obviously-correct implementation of
// every operation in mapping_table.h; the loader runs it on meta tensors to
// learn a target's shape before reading a byte, runs it for rules it has no
// fused path for, and the tests compare the fused path against it. Results may
// be views of the inputs (transpose, split, chunk): callers that keep them must
// copy when the inputs are read-only file mappings.
#pragma once

#include <ATen/core/Tensor.h>

#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "checkpoint/mapping_table.h"

namespace moefit::checkpoint {

// [source pattern][expert] (or [source pattern][0] once merged).
using TensorGroups = std::vector<std::vector<at::Tensor>>;

// Applies `ops` in order. Errors (InvalidArgument) name the op and what did not
// fit: a merge of differently shaped experts, a concatenate of mismatched
// tensors, an odd size to deinterleave, a chunk that does not divide, a dim out
// of range, a group shape the op does not accept.
absl::StatusOr<TensorGroups> ApplyOps(std::span<const ConversionOp> ops, TensorGroups groups);

}  // namespace moefit::checkpoint
