// The expert-backend interface: how one layer's routed experts are computed.
//
// A backend sees rows in segments, each segment the consecutive rows of one
// local expert: segment s holds counts[s] rows of expert s % E (E = the
// weights' expert count; counts.size() is a multiple of E). With E segments
// this is rows grouped by expert; with W*E it is what an all-to-all delivers
// (per source rank, grouped by expert), so no regrouping copy is needed. The
// packed weights are transformers v5's layout: gate_up_proj [E, 2I, H] (gate
// rows first, then up) and down_proj [E, H, I]. It computes, for each row a of
// expert e,
//     y[a] = down_e · (silu(gate_e · x[a]) ⊙ (up_e · x[a]))
// and, on request, the gradients. Routing weights are NOT applied here: they
// are applied on the token's home rank after combine, so that the router gets
// its gradient locally. Backends know nothing of ranks, files or routing.
//
// Every backend has its own forward and backward; `eager` (a plain per-expert
// loop) is the reference the others are tested against.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moefit::experts {

// Packed weights of one layer's local experts.
struct ExpertWeights {
  at::Tensor gate_up_proj;  // [E, 2I, H]
  at::Tensor down_proj;     // [E, H, I]
};

struct ExpertGrads {
  at::Tensor x;             // [A, H]
  at::Tensor gate_up_proj;  // [E, 2I, H]
  at::Tensor down_proj;     // [E, H, I]
};

struct BackendOptions {
  // CPU threads for expert compute; 0 = the process's intra-op thread count.
  int num_threads = 0;
};

class ExpertBackend {
 public:
  virtual ~ExpertBackend() = default;

  // Registry name ("eager", "grouped", ...).
  virtual std::string_view name() const = 0;

  // x: [A, H] with A = sum(counts) in segments (see above), same dtype and device as the weights
  // (float32, bfloat16 or float64; CPU). Returns y [A, H]. `*activations`
  // receives what Backward needs (the [A, 2I] gate/up pre-activations).
  // bfloat16 inputs are multiplied with fp32 accumulation.
  virtual at::Tensor Forward(const at::Tensor& x, const std::vector<int64_t>& counts,
                             const ExpertWeights& weights, at::Tensor* activations) = 0;

  // Gradients of sum(grad_y ⊙ y) with respect to x and both weight tensors,
  // given the inputs of Forward and the activations it saved. Experts with no
  // rows get zero weight gradients.
  virtual ExpertGrads Backward(const at::Tensor& grad_y, const at::Tensor& x,
                               const std::vector<int64_t>& counts, const ExpertWeights& weights,
                               const at::Tensor& activations) = 0;
};

}  // namespace moefit::experts
