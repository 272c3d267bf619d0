// The routed-expert computation as an autograd function.
//
// Wraps an ExpertBackend's Forward/Backward so that autograd calls the
// backend's own backward (not a graph of small ATen ops): one node per layer,
// whose inputs are the grouped rows and the two packed weight tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "experts/expert_backend.h"

namespace moefit::experts {

// y = backend(x, weights) with gradients to x, gate_up_proj and down_proj.
// x must have the weights' dtype and device; `backend` must outlive the
// backward pass.
at::Tensor ExpertFfn(ExpertBackend& backend, const at::Tensor& x,
                     const std::vector<int64_t>& counts, const at::Tensor& gate_up_proj,
                     const at::Tensor& down_proj);

// Wall-clock seconds this process has spent in expert backends (forward and
// backward) since it started: the "expert compute" of a step's time split.
double ExpertComputeSeconds();

}  // namespace moefit::experts
