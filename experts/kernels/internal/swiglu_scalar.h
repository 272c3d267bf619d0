// SwiGLU's activation and the softmax's exponentials on float32 rows, one
// element at a time with std::exp: the portable kernels' (see swiglu_avx2.h
// for the vector ones).
#pragma once

#include <cmath>
#include <cstdint>

namespace moefit::experts::kernels::internal {
namespace {

void SiluMulScalar(const float* g, const float* u, float* h, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float s = 1.0f / (1.0f + std::exp(-g[j]));
    h[j] = g[j] * s * u[j];
  }
}

void SiluMulBackwardScalar(const float* g, const float* u, const float* dh, float* h, float* dg,
                           float* du, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float s = 1.0f / (1.0f + std::exp(-g[j]));
    const float act = g[j] * s;
    h[j] = act * u[j];
    dg[j] = dh[j] * u[j] * s * (1.0f + g[j] * (1.0f - s));
    du[j] = dh[j] * act;
  }
}

// The softmax's exponentials: x[j] = exp(x[j] * scale - shift), their sum.
float ExpSumScalar(float* x, int64_t n, float scale, float shift) {
  float sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] * scale - shift);
    sum += x[j];
  }
  return sum;
}

}  // namespace
}  // namespace moefit::experts::kernels::internal
