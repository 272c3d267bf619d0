// A float32 block's row written to a bfloat16 output, eight lanes at a time
// (AVX2) or sixteen (AVX-512): the bits of StoreBf16RowScalar
// (pack_common.h), round to nearest even and NaN kept a quiet NaN. Included by the kernel files compiled for
// AVX2 and wider, with internal linkage (see packed_kernels.h).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "experts/kernels/internal/pack_common.h"

namespace moefit::experts::kernels::internal {
namespace {

void StoreBf16RowAvx2(const float* src, uint16_t* out, int64_t n, bool accumulate) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i bias = _mm256_set1_epi32(0x7fff);
  const __m256i quiet = _mm256_set1_epi32(0x40);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 v = _mm256_loadu_ps(src + j);
    if (accumulate) {
      const __m128i old = _mm_loadu_si128(reinterpret_cast<const __m128i*>(out + j));
      v = _mm256_add_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(old), 16)));
    }
    const __m256i u = _mm256_castps_si256(v);
    const __m256i high = _mm256_srli_epi32(u, 16);
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(high, one))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, quiet), nan);
    // Each lane holds at most 0xffff: packing with unsigned saturation keeps it.
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), packed);
  }
  StoreBf16RowScalar(src + j, out + j, n - j, accumulate);
}

#if defined(__AVX512F__)
// The same sixteen lanes at a time, for the files compiled for AVX-512; the
// rest of the row eight at a time.
void StoreBf16RowAvx512(const float* src, uint16_t* out, int64_t n, bool accumulate) {
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i bias = _mm512_set1_epi32(0x7fff);
  const __m512i quiet = _mm512_set1_epi32(0x40);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 v = _mm512_loadu_ps(src + j);
    if (accumulate) {
      const __m256i old = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + j));
      v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16)));
    }
    const __m512i u = _mm512_castps_si512(v);
    const __m512i high = _mm512_srli_epi32(u, 16);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(high, one))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512i r = _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(high, quiet));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), _mm512_cvtepi32_epi16(r));
  }
  StoreBf16RowAvx2(src + j, out + j, n - j, accumulate);
}
#endif

}  // namespace
}  // namespace moefit::experts::kernels::internal
