// AdamW as one fused pass per tensor, and the squared gradient norm without
// widened copies.
//
// LibTorch's AdamW runs a chain of whole-tensor ops per parameter (seven
// passes over memory, with temporaries the size of the parameter), which on a
// model with hundreds of experts makes the optimizer, not the experts, the
// step. Here each CPU float32 tensor is updated in one parallel pass that reads
// the gradient, the weight, m and v once and writes the last three once, with
// torch.optim.AdamW's arithmetic (decoupled weight decay, bias-corrected
// moments):
//     p ← p·(1 − lr·wd);  m ← β1·m + (1 − β1)·g;  v ← β2·v + (1 − β2)·g²
//     p ← p − lr/(1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + ε)
// Tensors on another device, or of another dtype, take the same formula as
// ATen ops: the slow, obviously-correct twin the fused pass is tested against.
// Where the CPU has AVX2 (and the expert kernels are not held narrower, see
// experts/kernels/isa.h), the pass runs eight elements at a time with the
// scalar loop's operations in its order, so the bits do not depend on it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace moefit::framework {

struct AdamWHyper {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  // How attached bfloat16 copies (AttachCopy) are rounded: to nearest even,
  // or stochastically -- up with probability equal to the fraction of a
  // bfloat16 step below the float32 value, so that the copy is the master on
  // average. The random bits are a hash of (seed, step, tensor, element):
  // the same on any thread count, run after run.
  bool stochastic_rounding = false;
  uint64_t seed = 0;
};

class FusedAdamW {
 public:
  struct Group {
    std::vector<at::Tensor> params;
    double weight_decay = 0;
  };

  // `fused` false: every tensor takes the ATen twin (for tests).
  FusedAdamW(std::vector<Group> groups, const AdamWHyper& hyper, bool fused = true);

  // One step at learning rate `lr`. Parameters without a gradient are skipped
  // (their step count does not advance), as in LibTorch.
  void Step(double lr);

  // Drops every gradient (set to none): the next backward writes fresh ones
  // instead of adding to zeroed buffers.
  void ZeroGrad();

  // A bfloat16 tensor of `param`'s shape (contiguous, CPU) that Step writes in
  // the same pass as the update: the updated float32 value, rounded (see
  // AdamWHyper::stochastic_rounding). For bfloat16 compute copies of float32
  // master weights: no second pass over the masters after the step.
  // `param` must be one of the optimizer's float32 CPU parameters. `key` and
  // `first_element` place its elements in a layout-independent numbering for
  // stochastic rounding's random bits (e.g. a hash of the parameter's name
  // and the offset of this rank's first expert in the whole tensor), so that
  // any process count draws the same bits for the same global element.
  void AttachCopy(const at::Tensor& param, at::Tensor copy, uint64_t key = 0,
                  int64_t first_element = 0);

  // Checkpointing: the parameters by group, and the state of groups()[g].params[i]
  // (m and v undefined until its first step), read and replaced as they are.
  struct TensorState {
    at::Tensor m, v;
    int64_t step = 0;
  };
  const std::vector<Group>& groups() const { return groups_; }
  TensorState tensor_state(size_t g, size_t i) const {
    const State& s = state_[g][i];
    return {s.m, s.v, s.step};
  }
  // Keeps the tensor's attached copy (AttachCopy) and its numbering.
  void set_tensor_state(size_t g, size_t i, TensorState t) {
    State& s = state_[g][i];
    s.m = std::move(t.m);
    s.v = std::move(t.v);
    s.step = t.step;
  }

 private:
  struct State {
    at::Tensor m, v;
    int64_t step = 0;
    at::Tensor copy;            // bfloat16, written by Step (AttachCopy)
    uint64_t key = 0;           // stochastic rounding's numbering of the
    int64_t first_element = 0;  // elements (AttachCopy)
  };
  std::vector<Group> groups_;
  std::vector<std::vector<State>> state_;
  AdamWHyper hyper_;
  bool fused_;
};

// Sum over `tensors` of the squared entries, accumulated in double: one pass
// over each CPU float32 or bfloat16 tensor, ATen ops elsewhere. Undefined
// tensors count zero.
double SquaredNormSum(const std::vector<at::Tensor>& tensors);

}  // namespace moefit::framework
