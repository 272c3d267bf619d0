// Generation of expert-layer problems; see expert_problem.h.
#include "tests/support/expert_problem.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <array>
#include <cmath>
#include <tuple>
#include <utility>

#include "checkpoint/fp8.h"
#include "experts/int4.h"
#include "experts/kernels/gemm.h"

namespace moefit::experts {

ExpertProblem MakeExpertProblem(const ExpertProblemShape& s, at::ScalarType dtype, uint64_t seed) {
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

ExpertWeights QuantizeFp8(const ExpertProblem& p) {
  constexpr std::array<int64_t, 2> kBlock{kernels::kScaleBlock, kernels::kScaleBlock};
  auto quantize = [&](const at::Tensor& w) {
    auto q = checkpoint::QuantizeBlockFp8(w, kBlock);
    TORCH_CHECK(q.ok(), q.status().ToString());
    return *std::move(q);
  };
  ExpertWeights w;
  std::tie(w.gate_up_proj, w.gate_up_scale) = quantize(p.gate_up_proj);
  std::tie(w.down_proj, w.down_scale) = quantize(p.down_proj);
  return w;
}

ExpertWeights QuantizeInt4Experts(const ExpertProblem& p, int64_t group_size, bool symmetric) {
  const Int4Weight gate_up = QuantizeInt4(p.gate_up_proj, group_size, symmetric);
  const Int4Weight down = QuantizeInt4(p.down_proj, group_size, symmetric);
  ExpertWeights w;
  w.gate_up_proj = gate_up.bytes;
  w.gate_up_scale = gate_up.scale;
  w.gate_up_zero_point = gate_up.zero_point;
  w.down_proj = down.bytes;
  w.down_scale = down.scale;
  w.down_zero_point = down.zero_point;
  w.int4_group_size = group_size;
  return w;
}

double ExpertForwardFlops(const ExpertProblemShape& s) {
  const double rows = static_cast<double>(s.num_tokens * s.top_k);
  return 2.0 * rows * s.hidden * (2.0 * s.intermediate) + 2.0 * rows * s.intermediate * s.hidden;
}

}  // namespace moefit::experts
