// The routed-expert computation as an autograd function.
//
// Wraps an ExpertBackend's Forward/Backward so that autograd calls the
// backend's own backward (not a graph of small ATen ops): one node per layer,
// whose inputs are the grouped rows, the two packed weight tensors and the
// layer's LoRA adapters, if any.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "experts/expert_backend.h"

namespace moefit::experts {

struct ExpertFfnOptions {
  // Keep only x between forward and backward and recompute the [A, 2I] gate/up
  // pre-activations in backward: less memory held across the step, for one
  // more gate/up GEMM (two thirds of the forward's FLOPs).
  bool recompute = false;
  // Float32 master weights of narrower compute weights (weights.gate_up_proj
  // and down_proj, e.g. bfloat16): the backend computes with the compute
  // weights, and their gradients go, in float32, to these leaves instead, so
  // that gradients accumulate and the optimizer updates in float32. Undefined:
  // the gradients go to the compute weights themselves.
  at::Tensor gate_up_master, down_master;
  // Rows read by index (ExpertBackend::Forward's x_index): row a of the
  // computation is x[row_index[a]] ([A] int64, host), and row r of x is read
  // by the rows row_copies[r, 0..f) ([R, f] int64, -1 where fewer), so its
  // gradient is theirs summed in that order (in float32 at least, rounded
  // once to x's dtype). Both undefined: x holds the A rows themselves.
  at::Tensor row_index, row_copies;
};

// y = backend(x, weights) ([A, H]) with gradients to x, to the base weights when either
// requires grad (otherwise no base weight-gradient work is done: a frozen
// base), and to every defined LoRA tensor. x must have the base weights' dtype
// and device, and y has it too; the LoRA tensors are float32 (or float64 with
// a float64 base). `backend` must outlive the backward pass.
at::Tensor ExpertFfn(ExpertBackend& backend, const at::Tensor& x,
                     const std::vector<int64_t>& counts, const ExpertWeights& weights,
                     const ExpertFfnOptions& options = {});

// The same without LoRA: ExpertFfn(backend, x, counts, {gate_up_proj, down_proj}).
at::Tensor ExpertFfn(ExpertBackend& backend, const at::Tensor& x,
                     const std::vector<int64_t>& counts, const at::Tensor& gate_up_proj,
                     const at::Tensor& down_proj);

// Wall-clock seconds this process has spent in expert backends (forward and
// backward) since it started: the "expert compute" of a step's time split.
double ExpertComputeSeconds();

namespace internal {

// The gradient of x where the computation read it by index (ExpertFfnOptions's
// row_index and row_copies): row r is per_row[row_copies[r, j]] summed over j
// in order (-1: none), in float32 (float64 for float64 rows), rounded once to
// per_row's dtype.
at::Tensor SumCopies(const at::Tensor& per_row, const at::Tensor& row_copies);

}  // namespace internal
}  // namespace moefit::experts
