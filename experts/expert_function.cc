// Autograd glue for the expert backends; see expert_function.h.
#include "experts/expert_function.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <chrono>
#include <numeric>

namespace moefit::experts {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<int64_t> compute_ns{0};

// Adds the lifetime of the object to compute_ns.
class ComputeTimer {
 public:
  ComputeTimer() : start_(std::chrono::steady_clock::now()) {}
  ~ComputeTimer() {
    compute_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - start_)
                      .count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

class ExpertFfnFunction : public torch::autograd::Function<ExpertFfnFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                            ExpertBackend* backend, const std::vector<int64_t>& counts) {
    ComputeTimer timer;
    at::Tensor activations;
    at::Tensor y = backend->Forward(x, counts, {gate_up_proj, down_proj}, &activations);
    ctx->save_for_backward({x, gate_up_proj, down_proj, activations});
    ctx->saved_data["backend"] = reinterpret_cast<int64_t>(backend);
    ctx->saved_data["counts"] = counts;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    ComputeTimer timer;
    const variable_list saved = ctx->get_saved_variables();
    auto* backend = reinterpret_cast<ExpertBackend*>(ctx->saved_data["backend"].toInt());
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    ExpertGrads g = backend->Backward(grad_outputs[0].to(saved[0].scalar_type()), saved[0],
                                      counts, {saved[1], saved[2]}, saved[3]);
    return {g.x, g.gate_up_proj, g.down_proj, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

double ExpertComputeSeconds() { return static_cast<double>(compute_ns.load()) * 1e-9; }

at::Tensor ExpertFfn(ExpertBackend& backend, const at::Tensor& x,
                     const std::vector<int64_t>& counts, const at::Tensor& gate_up_proj,
                     const at::Tensor& down_proj) {
  TORCH_CHECK(x.dim() == 2 && gate_up_proj.dim() == 3 && down_proj.dim() == 3,
              "expert inputs: x [A, H], gate_up_proj [E, 2I, H], down_proj [E, H, I]");
  TORCH_CHECK(gate_up_proj.size(0) > 0 &&
                  static_cast<int64_t>(counts.size()) % gate_up_proj.size(0) == 0,
              "counts has ", counts.size(), " segments, not a multiple of the weights' ",
              gate_up_proj.size(0), " experts");
  TORCH_CHECK(std::accumulate(counts.begin(), counts.end(), int64_t{0}) == x.size(0),
              "counts sum to ", std::accumulate(counts.begin(), counts.end(), int64_t{0}),
              " but x has ", x.size(0), " rows");
  TORCH_CHECK(x.scalar_type() == gate_up_proj.scalar_type() &&
                  x.scalar_type() == down_proj.scalar_type(),
              "expert input and weights must share a dtype");
  TORCH_CHECK(gate_up_proj.size(1) == 2 * down_proj.size(2) &&
                  gate_up_proj.size(2) == down_proj.size(1) && x.size(1) == down_proj.size(1),
              "expert weight shapes disagree: gate_up_proj ", gate_up_proj.sizes(),
              ", down_proj ", down_proj.sizes(), ", x ", x.sizes());
  return ExpertFfnFunction::apply(x.contiguous(), gate_up_proj, down_proj, &backend, counts);
}

}  // namespace moefit::experts
