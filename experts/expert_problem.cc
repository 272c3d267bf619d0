// Generation of expert-layer problems; see expert_problem.h.
#include "experts/expert_problem.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <tuple>
#include <utility>

namespace moefit::experts {

ExpertProblem MakeExpertProblem(const ExpertProblemShape& s, at::ScalarType dtype,
                                uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor ids;
  switch (s.pattern) {
    case RoutingPattern::kUniform:
      ids = at::randint(s.num_experts, {s.num_tokens * s.top_k}, gen, at::kLong);
      break;
    case RoutingPattern::kSkewed: {
      at::Tensor w = 1.0 / at::arange(1, s.num_experts + 1, f32).pow(1.2);
      ids = at::multinomial(w, s.num_tokens * s.top_k, /*replacement=*/true, gen);
      break;
    }
    case RoutingPattern::kOneExpert:
      ids = at::zeros({s.num_tokens * s.top_k}, at::kLong);
      break;
    case RoutingPattern::kSomeEmpty:
      ids = at::randint((s.num_experts + 1) / 2, {s.num_tokens * s.top_k}, gen, at::kLong) * 2;
      break;
  }
  at::Tensor counts_t = at::bincount(ids, {}, s.num_experts);
  ExpertProblem p;
  p.counts.assign(counts_t.data_ptr<int64_t>(), counts_t.data_ptr<int64_t>() + s.num_experts);
  const int64_t rows = s.num_tokens * s.top_k;
  p.x = at::randn({rows, s.hidden}, gen, f32).to(dtype);
  p.grad_y = at::randn({rows, s.hidden}, gen, f32).to(dtype);
  p.gate_up_proj = (at::randn({s.num_experts, 2 * s.intermediate, s.hidden}, gen, f32) /
                    std::sqrt(static_cast<double>(s.hidden)))
                       .to(dtype);
  p.down_proj = (at::randn({s.num_experts, s.hidden, s.intermediate}, gen, f32) /
                 std::sqrt(static_cast<double>(s.intermediate)))
                    .to(dtype);
  return p;
}

ExpertLora MakeExpertLora(const ExpertProblemShape& s, const LoraSpec& spec, at::ScalarType dtype,
                          uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
  const int64_t e = s.num_experts, r = spec.rank, h = s.hidden, i = s.intermediate;
  auto normal = [&](std::vector<int64_t> sizes, int64_t fan_in) {
    return (at::randn(sizes, gen, f32) / std::sqrt(static_cast<double>(fan_in))).to(dtype);
  };
  ExpertLora lora;
  lora.scaling = spec.scaling;
  if (spec.gate_up) {
    lora.gate_up_a = normal({e, r, h}, h);
    lora.gate_up_b = normal({e, 2 * i, r}, r);
  }
  if (spec.down) {
    lora.down_a = normal({e, r, i}, i);
    lora.down_b = normal({e, h, r}, r);
  }
  return lora;
}

namespace {

// w [E, R, C] -> (fp8 [E, R, C], scales [E, ceil(R/128), ceil(C/128)]).
std::pair<at::Tensor, at::Tensor> QuantizeBlocks(const at::Tensor& w) {
  const int64_t e = w.size(0), r = w.size(1), c = w.size(2);
  const int64_t br = (r + 127) / 128, bc = (c + 127) / 128;
  at::Tensor padded = at::zeros({e, br * 128, bc * 128});
  padded.narrow(1, 0, r).narrow(2, 0, c).copy_(w.to(at::kFloat));
  at::Tensor blocks = padded.view({e, br, 128, bc, 128});
  at::Tensor scales = blocks.abs().amax({2, 4}).div_(448.0).clamp_min_(1e-12);
  at::Tensor q = (blocks / scales.view({e, br, 1, bc, 1})).view({e, br * 128, bc * 128});
  return {q.narrow(1, 0, r).narrow(2, 0, c).to(at::kFloat8_e4m3fn).contiguous(),
          scales.contiguous()};
}

}  // namespace

ExpertWeights QuantizeFp8(const ExpertProblem& p) {
  ExpertWeights w;
  std::tie(w.gate_up_proj, w.gate_up_scale) = QuantizeBlocks(p.gate_up_proj);
  std::tie(w.down_proj, w.down_scale) = QuantizeBlocks(p.down_proj);
  return w;
}

double ExpertForwardFlops(const ExpertProblemShape& s) {
  const double rows = static_cast<double>(s.num_tokens * s.top_k);
  return 2.0 * rows * s.hidden * (2.0 * s.intermediate) + 2.0 * rows * s.intermediate * s.hidden;
}

}  // namespace moefit::experts
