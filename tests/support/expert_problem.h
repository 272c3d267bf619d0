// Expert-layer problems shared by the tests and the benchmarks, so that the
// cases checked for correctness are the ones timed (one harness, two modes).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "experts/expert_backend.h"

namespace moefit::experts {

enum class RoutingPattern {
  kUniform,    // top-k ids drawn uniformly at random
  kSkewed,     // Zipf-like: a few hot experts get most tokens
  kOneExpert,  // every assignment goes to expert 0
  kSomeEmpty,  // uniform over the even experts only: odd experts get no rows
};

struct ExpertProblemShape {
  std::string name;
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t num_experts = 0;
  int64_t top_k = 1;
  RoutingPattern pattern = RoutingPattern::kUniform;
};

struct ExpertProblem {
  at::Tensor x;                 // [A, H], rows grouped by expert, A = tokens * top_k
  std::vector<int64_t> counts;  // rows per expert
  at::Tensor gate_up_proj;      // [E, 2I, H]
  at::Tensor down_proj;         // [E, H, I]
  at::Tensor grad_y;            // [A, H] an upstream gradient
};

// Deterministic for a given seed; values ~N(0, 1) for x and grad_y and
// ~N(0, 1/sqrt(fan_in)) for the weights, in `dtype`, on the CPU.
ExpertProblem MakeExpertProblem(const ExpertProblemShape& shape, at::ScalarType dtype,
                                uint64_t seed);

// Which LoRA adapters MakeExpertLora makes, and their rank and scaling.
struct LoraSpec {
  int64_t rank = 4;
  bool gate_up = true;
  bool down = true;
  double scaling = 2.0;
};

// Deterministic for a given seed: A ~N(0, 1/sqrt(fan_in)) and B ~N(0, 1/sqrt(r))
// (B nonzero, unlike a fresh PEFT adapter, so that every gradient path is
// exercised), in `dtype`, on the CPU; the pairs not in `spec` are undefined.
ExpertLora MakeExpertLora(const ExpertProblemShape& shape, const LoraSpec& spec,
                          at::ScalarType dtype, uint64_t seed);

// The problem's weights quantized to float8_e4m3fn with one float32 scale per
// 128 x 128 block (checkpoint::QuantizeBlockFp8), for the frozen-FP8 paths.
ExpertWeights QuantizeFp8(const ExpertProblem& problem);

// The problem's weights quantized to int4 in groups of group_size inputs
// (QuantizeInt4, int4.h), for the frozen-int4 paths.
ExpertWeights QuantizeInt4Experts(const ExpertProblem& problem, int64_t group_size,
                                  bool symmetric = true);

// Multiply-adds of forward and backward: 2*A*H*(2I) + 2*A*I*H forward, twice that backward.
double ExpertForwardFlops(const ExpertProblemShape& shape);

}  // namespace moefit::experts
