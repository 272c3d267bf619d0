// AVX-512 float32 kernels (compiled with -mavx512f -mavx512bw -mavx512vl
// -mfma -mf16c): a 12 x 32 microkernel (24 accumulators, masked partial
// stores), bfloat16 and FP8 operands converted to float32 as they are packed.
#include <immintrin.h>

#define MOEFIT_PACK_WIDTH 16
#include "experts/kernels/internal/pack_x86.h"
#include "experts/kernels/internal/packed_kernels.h"

namespace moefit::experts::kernels::internal {
namespace {

constexpr int kMr = 12;
constexpr int kNr = 32;

template <int kRows>
inline void MicroRows(int64_t k_size, const float* ap, const float* bp, float* c, int64_t ldc,
                      int cols, bool accumulate) {
  __m512 acc0[kRows], acc1[kRows];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    const __m512 b0 = _mm512_loadu_ps(bp + k * kNr);
    const __m512 b1 = _mm512_loadu_ps(bp + k * kNr + 16);
    const float* a = ap + k * kMr;
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      const __m512 av = _mm512_set1_ps(a[r]);
      acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
    }
  }
  const __mmask16 m0 = cols >= 16 ? __mmask16(0xffff) : __mmask16((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32  ? __mmask16(0xffff)
                       : cols > 16 ? __mmask16((1u << (cols - 16)) - 1)
                                   : __mmask16(0);
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    float* row = c + r * ldc;
    if (accumulate) {
      acc0[r] = _mm512_add_ps(acc0[r], _mm512_maskz_loadu_ps(m0, row));
      acc1[r] = _mm512_add_ps(acc1[r], _mm512_maskz_loadu_ps(m1, row + 16));
    }
    _mm512_mask_storeu_ps(row, m0, acc0[r]);
    _mm512_mask_storeu_ps(row + 16, m1, acc1[r]);
  }
}

void Micro(int64_t k_size, const void* a_panel, const void* b_panel, float* c, int64_t ldc,
           int rows, int cols, bool accumulate) {
  const auto* ap = static_cast<const float*>(a_panel);
  const auto* bp = static_cast<const float*>(b_panel);
  switch (rows) {
    case 1:
      return MicroRows<1>(k_size, ap, bp, c, ldc, cols, accumulate);
    case 2:
      return MicroRows<2>(k_size, ap, bp, c, ldc, cols, accumulate);
    case 3:
      return MicroRows<3>(k_size, ap, bp, c, ldc, cols, accumulate);
    case 4:
      return MicroRows<4>(k_size, ap, bp, c, ldc, cols, accumulate);
    case 5:
      return MicroRows<5>(k_size, ap, bp, c, ldc, cols, accumulate);
    case 6:
      return MicroRows<6>(k_size, ap, bp, c, ldc, cols, accumulate);
    case 7:
      return MicroRows<7>(k_size, ap, bp, c, ldc, cols, accumulate);
    case 8:
      return MicroRows<8>(k_size, ap, bp, c, ldc, cols, accumulate);
    case 9:
      return MicroRows<9>(k_size, ap, bp, c, ldc, cols, accumulate);
    case 10:
      return MicroRows<10>(k_size, ap, bp, c, ldc, cols, accumulate);
    case 11:
      return MicroRows<11>(k_size, ap, bp, c, ldc, cols, accumulate);
    default:
      return MicroRows<12>(k_size, ap, bp, c, ldc, cols, accumulate);
  }
}

}  // namespace

const PackedKernels& Avx512F32Kernels() {
  static const PackedKernels k{"avx512",
                               kMr,
                               kNr,
                               /*kb=*/256,
                               /*nb=*/2048,
                               /*mb=*/96,
                               /*pairs=*/false,
                               &PackAGeneric<kMr, false>,
                               &PackBF32<kNr>,
                               &Micro,
                               &SmallRowsUpTo8};
  return k;
}

}  // namespace moefit::experts::kernels::internal
