// AVX-512 float32 kernels (compiled with -mavx512f -mavx512bw -mavx512vl
// -mfma -mf16c): a 12 x 32 microkernel (24 accumulators, masked partial
// stores), bfloat16 and FP8 operands converted to float32 as they are packed.
// A block of at most 16 columns (a LoRA rank's) multiplies only the half of
// the B panel it has.
#include "experts/kernels/internal/x86_intrinsics.h"

#define MOEFIT_PACK_WIDTH 16
#include "experts/kernels/internal/bf16_rows_avx512.h"
#include "experts/kernels/internal/pack_x86.h"
#include "experts/kernels/internal/packed_kernels.h"
#include "experts/kernels/internal/swiglu_avx2.h"

namespace moefit::experts::kernels::internal {
namespace {

constexpr int kMr = kAvx512F32Mr;
constexpr int kNr = kAvx512F32Nr;

template <int kRows, bool kWide>
inline void MicroRows(int64_t k_size, const float* ap, const float* bp, float* c, int64_t ldc,
                      int cols, bool accumulate) {
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

void Micro(int64_t k_size, const void* a_panel, const void* b_panel, float* c, int64_t ldc,
           int rows, int cols, bool accumulate) {
  const auto* ap = static_cast<const float*>(a_panel);
  const auto* bp = static_cast<const float*>(b_panel);
  WithRowsAndWidth<kMr>(rows, cols > kNr / 2, [&]<int R, bool kWide>() {
    MicroRows<R, kWide>(k_size, ap, bp, c, ldc, cols, accumulate);
  });
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
                               &PackAF32<kMr>,
                               &PackBF32<kNr>,
                               &Micro,
                               &SmallRows<>,
                               &SiluMulAvx2,
                               &SiluMulBackwardAvx2,
                               &StoreBf16RowAvx512};
  return k;
}

}  // namespace moefit::experts::kernels::internal
