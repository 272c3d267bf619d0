// A float32 block's row written to a bfloat16 output, eight lanes at a time
// (AVX2): the bits of StoreBf16RowScalar (pack_common.h), round to nearest
// even and NaN kept a quiet NaN. Included by the kernel files compiled for
// AVX2 and wider, with internal linkage (see packed_kernels.h).
#pragma once

#include <cstdint>

#include "experts/kernels/internal/pack_common.h"
#include "experts/kernels/internal/x86_intrinsics.h"

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

}  // namespace
}  // namespace moefit::experts::kernels::internal
