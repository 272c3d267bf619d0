// Gradient synchronization: sums gradients over a group, in buckets.
//
// Small tensors are packed into flat buckets of one dtype (at most
// `bucket_bytes` each) so that a model with thousands of parameters costs a
// few large all-reduces rather than thousands of small ones; the bucket moves
// to the communicator's device and back. The loss is normalized by the global
// token count, so a plain sum is the global gradient.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "parallel/communicator.h"

namespace moefit::parallel {

struct GradSyncOptions {
  int64_t bucket_bytes = 32 << 20;
};

// In place: each defined tensor becomes its sum over `comm`. Every rank must
// pass tensors of the same shapes and dtypes in the same order. Throws
// c10::Error when a collective fails.
void AllReduceSum(Communicator& comm, const std::vector<at::Tensor>& tensors,
                  const GradSyncOptions& options = {});

}  // namespace moefit::parallel
