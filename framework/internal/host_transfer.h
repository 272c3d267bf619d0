// Activations between the dense device and the host, where the routed
// experts compute: the only tensors that cross PCIe in a step.
//
// MoveActivations is differentiable (its backward moves the gradient back the
// other way) and is the identity when the tensor is already on `device`, so a
// run with the dense layers on the CPU copies nothing. From a GPU it copies
// into pinned (page-locked) host memory with a non-blocking copy on the
// current stream and then waits for that stream, so the CPU reads complete
// rows; to a GPU it stages the rows in pinned memory and copies without
// waiting (stream order protects the copy). Pinned blocks come from
// LibTorch's caching host allocator: a block is reused once the copies that
// read or wrote it have finished (ATen records them on the block), so
// steady-state steps allocate no pinned memory. Pinned DMA runs at the
// link's speed; pageable copies go through a driver bounce buffer.
//
// Every byte moved between a GPU and the host, forward and backward, is
// counted process-wide (PcieBytes), for the step metrics.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>

namespace moefit::framework::internal {

// `x` on `device` (CPU or a CUDA device); the same tensor when it is there
// already. Differentiable in `x`.
at::Tensor MoveActivations(const at::Tensor& x, c10::Device device);

// Bytes this process has copied between a GPU and the host through
// MoveActivations since it started.
int64_t PcieBytes();

}  // namespace moefit::framework::internal
