// SwiGLU's activation and the softmax's exponentials on float32 rows, eight
// lanes at a time (AVX2 + FMA): included by the kernel files compiled for AVX2
// and wider, with internal linkage (see packed_kernels.h). exp is Cephes'
// single-precision polynomial (range reduction by ln 2 in two parts, degree-5
// polynomial, exponent bits added back): a few units in the last place of
// expf over the clamped range; the remainder of each row takes the scalar
// loops (swiglu_scalar.h).
#pragma once

#include <cstdint>

#include "experts/kernels/internal/swiglu_scalar.h"
#include "experts/kernels/internal/x86_intrinsics.h"

namespace moefit::experts::kernels::internal {
namespace {

inline __m256 ExpAvx2(__m256 x) {
  // Clamped where expf over- or underflows: sigmoid is then 0 or 1 to far
  // below float32's resolution of the products it feeds.
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447504f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// 1 / (1 + exp(-g))
inline __m256 SigmoidAvx2(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, ExpAvx2(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

void SiluMulAvx2(const float* g, const float* u, float* h, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 gv = _mm256_loadu_ps(g + j);
    const __m256 act = _mm256_mul_ps(gv, SigmoidAvx2(gv));
    _mm256_storeu_ps(h + j, _mm256_mul_ps(act, _mm256_loadu_ps(u + j)));
  }
  SiluMulScalar(g + j, u + j, h + j, n - j);
}

void SiluMulBackwardAvx2(const float* g, const float* u, const float* dh, float* h, float* dg,
                         float* du, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 gv = _mm256_loadu_ps(g + j), uv = _mm256_loadu_ps(u + j);
    const __m256 d = _mm256_loadu_ps(dh + j);
    const __m256 s = SigmoidAvx2(gv);
    const __m256 act = _mm256_mul_ps(gv, s);
    _mm256_storeu_ps(h + j, _mm256_mul_ps(act, uv));
    const __m256 slope = _mm256_add_ps(one, _mm256_mul_ps(gv, _mm256_sub_ps(one, s)));
    _mm256_storeu_ps(dg + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(d, uv), s), slope));
    _mm256_storeu_ps(du + j, _mm256_mul_ps(d, act));
  }
  SiluMulBackwardScalar(g + j, u + j, dh + j, h + j, dg + j, du + j, n - j);
}

// The softmax's exponentials: x[j] = exp(x[j] * scale - shift), their sum
// (eight lane sums, then across the lanes, then the remainder's).
float ExpSumAvx2(float* x, int64_t n, float scale, float shift) {
  const __m256 vs = _mm256_set1_ps(scale), vshift = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = ExpAvx2(_mm256_fmsub_ps(_mm256_loadu_ps(x + j), vs, vshift));
    _mm256_storeu_ps(x + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float sum = 0;
  for (float v : lanes) sum += v;
  return sum + ExpSumScalar(x + j, n - j, scale, shift);
}

}  // namespace
}  // namespace moefit::experts::kernels::internal
