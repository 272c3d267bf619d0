// AVX2 + FMA float32 kernels (compiled with -mavx2 -mfma -mf16c): a 6 x 16
// microkernel (12 accumulators), bfloat16 and FP8 operands converted to
// float32 as they are packed. A block of at most 8 columns multiplies only
// the half of the B panel it has.
#include "experts/kernels/internal/x86_intrinsics.h"

#define MOEFIT_PACK_WIDTH 8
#include "experts/kernels/internal/bf16_rows_avx2.h"
#include "experts/kernels/internal/pack_x86.h"
#include "experts/kernels/internal/packed_kernels.h"
#include "experts/kernels/internal/swiglu_avx2.h"

namespace moefit::experts::kernels::internal {
namespace {

constexpr int kMr = 6;
constexpr int kNr = 16;

template <int kRows, bool kWide>
inline void MicroRows(int64_t k_size, const float* ap, const float* bp, float* c, int64_t ldc,
                      int cols, bool accumulate) {
  __m256 acc0[kRows], acc1[kRows];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    const __m256 b0 = _mm256_loadu_ps(bp + k * kNr);
    const __m256 b1 = kWide ? _mm256_loadu_ps(bp + k * kNr + 8) : b0;
    const float* a = ap + k * kMr;
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r);
      acc0[r] = _mm256_fmadd_ps(av, b0, acc0[r]);
      if constexpr (kWide) acc1[r] = _mm256_fmadd_ps(av, b1, acc1[r]);
    }
  }
  if (cols == kNr) {
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      float* row = c + r * ldc;
      if (accumulate) {
        acc0[r] = _mm256_add_ps(acc0[r], _mm256_loadu_ps(row));
        acc1[r] = _mm256_add_ps(acc1[r], _mm256_loadu_ps(row + 8));
      }
      _mm256_storeu_ps(row, acc0[r]);
      _mm256_storeu_ps(row + 8, acc1[r]);
    }
    return;
  }
  float tile[kMr * kNr];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_ps(tile + r * kNr, acc0[r]);
    _mm256_storeu_ps(tile + r * kNr + 8, acc1[r]);
  }
  StoreTile<kNr>(tile, c, ldc, kRows, cols, accumulate);
}

void Micro(int64_t k_size, const void* a_panel, const void* b_panel, float* c, int64_t ldc,
           int rows, int cols, bool accumulate) {
  const auto* ap = static_cast<const float*>(a_panel);
  const auto* bp = static_cast<const float*>(b_panel);
  WithRowsAndWidth<kMr>(rows, cols > kNr / 2, [&]<int R, bool kWide>() {
    MicroRows<R, kWide>(k_size, ap, bp, c, ldc, cols, accumulate);
  });
}

}  // namespace

const PackedKernels& Avx2F32Kernels() {
  static const PackedKernels k{"avx2",
                               kMr,
                               kNr,
                               /*kb=*/256,
                               /*nb=*/2048,
                               /*mb=*/96,
                               /*pairs=*/false,
                               &PackAF32<kMr>,
                               &PackBF32<kNr>,
                               &Micro,
                               &SmallRows<>,
                               &SiluMulAvx2,
                               &SiluMulBackwardAvx2,
                               &StoreBf16RowAvx2};
  return k;
}

}  // namespace moefit::experts::kernels::internal
