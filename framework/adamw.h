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
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace moefit::framework {

struct AdamWHyper {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
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

 private:
  struct State {
    at::Tensor m, v;
    int64_t step = 0;
  };
  std::vector<Group> groups_;
  std::vector<std::vector<State>> state_;
  AdamWHyper hyper_;
  bool fused_;

 public:
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
  void set_tensor_state(size_t g, size_t i, TensorState t) {
    state_[g][i] = {std::move(t.m), std::move(t.v), t.step};
  }
};

// Sum over `tensors` of the squared entries, accumulated in double: one pass
// over each CPU float32 or bfloat16 tensor, ATen ops elsewhere. Undefined
// tensors count zero.
double SquaredNormSum(const std::vector<at::Tensor>& tensors);

}  // namespace moefit::framework
