// The reference backend: one expert at a time, ATen ops only; see eager_backend.h.
#include "experts/eager_backend.h"

#include <ATen/ATen.h>

#include "experts/int4.h"

namespace moefit::experts {
namespace {

// s·(in·aᵀ)·bᵀ, the LoRA term of one projection, in the adapters' dtype.
at::Tensor LoraTerm(const at::Tensor& in, const at::Tensor& a, const at::Tensor& b, double s) {
  return at::matmul(at::matmul(in.to(a.scalar_type()), a.t()), b.t()) * s;
}

// base + term, summed in term's dtype and returned in base's.
at::Tensor AddLora(const at::Tensor& base, const at::Tensor& term) {
  return (base.to(term.scalar_type()) + term).to(base.scalar_type());
}

// Backward of one projection's LoRA term s·(in·aᵀ)·bᵀ given its output
// gradient d_out: adds to grad_a and grad_b, returns the term's input gradient
// (in the adapters' dtype).
at::Tensor LoraBackward(const at::Tensor& in, const at::Tensor& d_out, const at::Tensor& a,
                        const at::Tensor& b, double s, at::Tensor grad_a, at::Tensor grad_b) {
  const at::ScalarType dt = a.scalar_type();
  at::Tensor in_l = in.to(dt), d_l = d_out.to(dt);
  at::Tensor u = at::matmul(in_l, a.t());
  grad_b.add_(at::matmul(d_l.t(), u) * s);
  at::Tensor du = at::matmul(d_l, b) * s;
  grad_a.add_(at::matmul(du.t(), in_l));
  return at::matmul(du, a);
}

// Expert e's weight in the activations' dtype: FP8 times its block scales,
// each 128 x 128 block dequantized as a whole, rounded once to `dtype`; int4
// as its checkpoint's library dequantizes it (bfloat16 values, exact in
// `dtype`). `cols`: the weight's columns (an int4 weight's bytes hold them
// padded).
at::Tensor Weight(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& zero_point,
                  int64_t group, int64_t cols, int64_t e, at::ScalarType dtype) {
  if (w.scalar_type() == at::kByte) {
    return DequantizeInt4({w[e], scale[e], zero_point.defined() ? zero_point[e] : zero_point},
                          group, cols)
        .to(dtype);
  }
  if (w.scalar_type() != at::kFloat8_e4m3fn) return w[e];
  const at::Tensor s = scale[e].repeat_interleave(128, 0).repeat_interleave(128, 1);
  return (w[e].to(at::kFloat) * s.narrow(0, 0, w.size(1)).narrow(1, 0, w.size(2))).to(dtype);
}

at::Tensor GateUpWeight(const ExpertWeights& w, int64_t e, at::ScalarType dtype) {
  return Weight(w.gate_up_proj, w.gate_up_scale, w.gate_up_zero_point, w.int4_group_size,
                w.hidden(), e, dtype);
}

at::Tensor DownWeight(const ExpertWeights& w, int64_t e, at::ScalarType dtype) {
  return Weight(w.down_proj, w.down_scale, w.down_zero_point, w.int4_group_size, w.intermediate(),
                e, dtype);
}

// The [n, 2I] gate/up pre-activations of rows `xe` of expert e.
at::Tensor GateUp(const at::Tensor& xe, int64_t e, const ExpertWeights& w) {
  at::Tensor gu = at::matmul(xe, GateUpWeight(w, e, xe.scalar_type()).t());
  if (w.lora.has_gate_up()) {
    gu = AddLora(gu, LoraTerm(xe, w.lora.gate_up_a[e], w.lora.gate_up_b[e], w.lora.scaling));
  }
  return gu;
}

class EagerBackend final : public ExpertBackend {
 public:
  std::string_view name() const override { return "eager"; }

  using ExpertBackend::Backward;
  using ExpertBackend::Forward;

  // Rows read by index are copied out first: the plain reading of x_index.
  at::Tensor Forward(const at::Tensor& x_in, const at::Tensor& x_index,
                     const std::vector<int64_t>& counts, const ExpertWeights& w,
                     at::Tensor* activations) override {
    const at::Tensor x = x_index.defined() ? x_in.index_select(0, x_index) : x_in;
    const int64_t inter = w.intermediate();
    const ExpertLora& lora = w.lora;
    at::Tensor y = at::zeros({x.size(0), w.hidden()}, x.options());
    at::Tensor gate_up;
    if (activations != nullptr) gate_up = at::zeros({x.size(0), 2 * inter}, x.options());
    const int64_t num_experts = w.gate_up_proj.size(0);
    int64_t row = 0;
    for (size_t s = 0; s < counts.size(); ++s) {
      const int64_t n = counts[s], e = static_cast<int64_t>(s) % num_experts;
      if (n == 0) continue;
      at::Tensor xe = x.narrow(0, row, n);
      at::Tensor gu = GateUp(xe, e, w);
      at::Tensor h = at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter);
      at::Tensor ye = at::matmul(h, DownWeight(w, e, h.scalar_type()).t());
      if (lora.has_down()) {
        ye = AddLora(ye, LoraTerm(h, lora.down_a[e], lora.down_b[e], lora.scaling));
      }
      y.narrow(0, row, n).copy_(ye);
      if (gate_up.defined()) gate_up.narrow(0, row, n).copy_(gu);
      row += n;
    }
    if (activations != nullptr) *activations = gate_up;
    return y;
  }

  ExpertGrads Backward(const at::Tensor& grad_y, const at::Tensor& x_in, const at::Tensor& x_index,
                       const std::vector<int64_t>& counts, const ExpertWeights& w,
                       const at::Tensor& activations, const BackwardOptions& options) override {
    const at::Tensor x = x_index.defined() ? x_in.index_select(0, x_index) : x_in;
    const int64_t inter = w.intermediate();
    const ExpertLora& lora = w.lora;
    const double scale = lora.scaling;
    ExpertGrads g;
    g.x = at::zeros_like(x);
    if (options.base_weight_grads) {
      TORCH_CHECK(w.gate_up_proj.scalar_type() != at::kFloat8_e4m3fn && !w.int4(),
                  "FP8 and int4 expert weights are frozen: they have no weight gradients");
      g.gate_up_proj = at::zeros_like(w.gate_up_proj);
      g.down_proj = at::zeros_like(w.down_proj);
    }
    if (lora.has_gate_up()) {
      g.gate_up_a = at::zeros_like(lora.gate_up_a);
      g.gate_up_b = at::zeros_like(lora.gate_up_b);
    }
    if (lora.has_down()) {
      g.down_a = at::zeros_like(lora.down_a);
      g.down_b = at::zeros_like(lora.down_b);
    }
    const int64_t num_experts = w.gate_up_proj.size(0);
    int64_t row = 0;
    for (size_t s = 0; s < counts.size(); ++s) {
      const int64_t n = counts[s], e = static_cast<int64_t>(s) % num_experts;
      if (n == 0) continue;
      at::Tensor xe = x.narrow(0, row, n);
      at::Tensor dy = grad_y.narrow(0, row, n);
      at::Tensor gu = activations.defined() ? activations.narrow(0, row, n) : GateUp(xe, e, w);
      at::Tensor gate = gu.narrow(1, 0, inter);
      at::Tensor up = gu.narrow(1, inter, inter);
      at::Tensor sig = at::sigmoid(gate);
      at::Tensor act = gate * sig;  // silu(gate)
      at::Tensor h = act * up;
      at::Tensor dh = at::matmul(dy, DownWeight(w, e, dy.scalar_type()));
      if (lora.has_down()) {
        dh = AddLora(dh, LoraBackward(h, dy, lora.down_a[e], lora.down_b[e], scale, g.down_a[e],
                                      g.down_b[e]));
      }
      if (options.base_weight_grads) g.down_proj[e].add_(at::matmul(dy.t(), h));
      at::Tensor d_gate = dh * up * (sig * (1 + gate * (1 - sig)));
      at::Tensor d_up = dh * act;
      at::Tensor d_gu = at::cat({d_gate, d_up}, 1);
      if (options.base_weight_grads) g.gate_up_proj[e].add_(at::matmul(d_gu.t(), xe));
      at::Tensor dx = at::matmul(d_gu, GateUpWeight(w, e, d_gu.scalar_type()));
      if (lora.has_gate_up()) {
        dx = AddLora(dx, LoraBackward(xe, d_gu, lora.gate_up_a[e], lora.gate_up_b[e], scale,
                                      g.gate_up_a[e], g.gate_up_b[e]));
      }
      g.x.narrow(0, row, n).copy_(dx);
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
