// A float32 block's row written to a bfloat16 output, sixteen lanes at a time
// (AVX-512F/BW): the bits of StoreBf16RowScalar (pack_common.h), round to
// nearest even and NaN kept a quiet NaN, as StoreBf16RowAvx2 with twice its
// width. Included by the kernel files compiled for AVX-512, with internal
// linkage (see packed_kernels.h).
#pragma once

#include <cstdint>

#include "experts/kernels/internal/pack_common.h"
#include "experts/kernels/internal/x86_intrinsics.h"

namespace moefit::experts::kernels::internal {
namespace {

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
    const __m512i r = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, quiet));
    // Each lane holds at most 0xffff: truncating to 16 bits keeps it.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), _mm512_cvtepi32_epi16(r));
  }
  StoreBf16RowScalar(src + j, out + j, n - j, accumulate);
}

}  // namespace
}  // namespace moefit::experts::kernels::internal
