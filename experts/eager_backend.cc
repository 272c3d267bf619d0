// The reference backend: one expert at a time, ATen ops only; see eager_backend.h.
#include "experts/eager_backend.h"

#include <ATen/ATen.h>

namespace moefit::experts {
namespace {

class EagerBackend final : public ExpertBackend {
 public:
  std::string_view name() const override { return "eager"; }

  at::Tensor Forward(const at::Tensor& x, const std::vector<int64_t>& counts,
                     const ExpertWeights& w, at::Tensor* activations) override {
    const int64_t inter = w.down_proj.size(2);
    at::Tensor y = at::zeros({x.size(0), w.down_proj.size(1)}, x.options());
    at::Tensor gate_up = at::zeros({x.size(0), 2 * inter}, x.options());
    const int64_t num_experts = w.gate_up_proj.size(0);
    int64_t row = 0;
    for (size_t s = 0; s < counts.size(); ++s) {
      const int64_t n = counts[s], e = static_cast<int64_t>(s) % num_experts;
      if (n == 0) continue;
      at::Tensor xe = x.narrow(0, row, n);
      at::Tensor gu = at::matmul(xe, w.gate_up_proj[e].t());
      at::Tensor h = at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter);
      y.narrow(0, row, n).copy_(at::matmul(h, w.down_proj[e].t()));
      gate_up.narrow(0, row, n).copy_(gu);
      row += n;
    }
    *activations = gate_up;
    return y;
  }

  ExpertGrads Backward(const at::Tensor& grad_y, const at::Tensor& x,
                       const std::vector<int64_t>& counts, const ExpertWeights& w,
                       const at::Tensor& activations) override {
    const int64_t inter = w.down_proj.size(2);
    ExpertGrads g;
    g.x = at::zeros_like(x);
    g.gate_up_proj = at::zeros_like(w.gate_up_proj);
    g.down_proj = at::zeros_like(w.down_proj);
    const int64_t num_experts = w.gate_up_proj.size(0);
    int64_t row = 0;
    for (size_t s = 0; s < counts.size(); ++s) {
      const int64_t n = counts[s], e = static_cast<int64_t>(s) % num_experts;
      if (n == 0) continue;
      at::Tensor xe = x.narrow(0, row, n);
      at::Tensor dy = grad_y.narrow(0, row, n);
      at::Tensor gu = activations.narrow(0, row, n);
      at::Tensor gate = gu.narrow(1, 0, inter);
      at::Tensor up = gu.narrow(1, inter, inter);
      at::Tensor sig = at::sigmoid(gate);
      at::Tensor act = gate * sig;  // silu(gate)
      at::Tensor h = act * up;
      at::Tensor dh = at::matmul(dy, w.down_proj[e]);
      g.down_proj[e].add_(at::matmul(dy.t(), h));
      at::Tensor d_gate = dh * up * (sig * (1 + gate * (1 - sig)));
      at::Tensor d_up = dh * act;
      at::Tensor d_gu = at::cat({d_gate, d_up}, 1);
      g.gate_up_proj[e].add_(at::matmul(d_gu.t(), xe));
      g.x.narrow(0, row, n).copy_(at::matmul(d_gu, w.gate_up_proj[e]));
      row += n;
    }
    return g;
  }
};

}  // namespace

std::unique_ptr<ExpertBackend> CreateEagerBackend(const BackendOptions&) {
  return std::make_unique<EagerBackend>();
}

}  // namespace moefit::experts
