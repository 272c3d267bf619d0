// The AVX-512 float32 microkernel: 12 x 32 (24 accumulators, masked partial
// stores) over float32 panels (packed_kernels.h). The avx512 kernels multiply
// with it, and so do the avx512_bf16 kernels on CPUs whose vdpbf16ps gives
// fewer multiply-adds per second than float32 FMAs (isa.h), with the bfloat16
// and FP8 weights widened to float32 as they are packed. Included after
// pack_x86.h with MOEFIT_PACK_WIDTH 16; internal linkage, like pack_common.h.
#pragma once

#include "experts/kernels/internal/pack_x86.h"
#include "experts/kernels/internal/x86_intrinsics.h"

namespace moefit::experts::kernels::internal {
namespace {

constexpr int kMrF32Avx512 = 12;
constexpr int kNrF32Avx512 = 32;

// A block of at most 16 columns (a LoRA rank's) multiplies only the half of
// the B panel it has (kWide false).
template <int kRows, bool kWide>
inline void MicroRowsF32Avx512(int64_t k_size, const float* ap, const float* bp, float* c,
                               int64_t ldc, int cols, bool accumulate) {
  constexpr int kMr = kMrF32Avx512, kNr = kNrF32Avx512;
  __m512 acc0[kRows], acc1[kRows];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    const __m512 b0 = _mm512_loadu_ps(bp + k * kNr);
    const __m512 b1 = kWide ? _mm512_loadu_ps(bp + k * kNr + 16) : b0;
    const float* a = ap + k * kMr;
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      const __m512 av = _mm512_set1_ps(a[r]);
      acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
      if constexpr (kWide) acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
    }
  }
  StoreRows32<kRows>(acc0, acc1, c, ldc, cols, accumulate);
}

void MicroF32Avx512(int64_t k_size, const void* a_panel, const void* b_panel, float* c, int64_t ldc,
                    int rows, int cols, bool accumulate) {
  const auto* ap = static_cast<const float*>(a_panel);
  const auto* bp = static_cast<const float*>(b_panel);
  WithRowsAndWidth<kMrF32Avx512>(rows, cols > kNrF32Avx512 / 2, [&]<int R, bool kWide>() {
    MicroRowsF32Avx512<R, kWide>(k_size, ap, bp, c, ldc, cols, accumulate);
  });
}

}  // namespace
}  // namespace moefit::experts::kernels::internal
