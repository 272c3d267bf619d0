// AVX-512 BF16 kernels (compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512bf16): a 12 x 32 microkernel on bfloat16 pairs with vdpbf16ps, which
// multiplies two bfloat16 pairs per 32-bit lane and adds both products to a
// float32 accumulator -- twice the multiply-adds of a float32 FMA per
// instruction. Used when B (the weight) is bfloat16 or FP8: A is rounded to
// bfloat16 as it is packed, FP8 x scale too.
#include "experts/kernels/internal/x86_intrinsics.h"

#define MOEFIT_PACK_WIDTH 16
#include "experts/kernels/internal/bf16_rows_avx512.h"
#include "experts/kernels/internal/pack_pairs_avx512.h"
#include "experts/kernels/internal/packed_kernels.h"
#include "experts/kernels/internal/swiglu_avx2.h"

namespace moefit::experts::kernels::internal {
namespace {

constexpr int kMr = 12;
constexpr int kNr = 32;

template <int kRows>
inline void MicroRows(int64_t k_size, const uint32_t* ap, const uint32_t* bp, float* c, int64_t ldc,
                      int cols, bool accumulate) {
  const int64_t kp = (k_size + 1) / 2;
  __m512 acc0[kRows], acc1[kRows];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + p * kNr);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + p * kNr + 16);
    const uint32_t* a = ap + p * kMr;
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r]));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], av, b0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], av, b1);
    }
  }
  StoreRows32<kRows>(acc0, acc1, c, ldc, cols, accumulate);
}

void Micro(int64_t k_size, const void* a_panel, const void* b_panel, float* c, int64_t ldc,
           int rows, int cols, bool accumulate) {
  const auto* ap = static_cast<const uint32_t*>(a_panel);
  const auto* bp = static_cast<const uint32_t*>(b_panel);
  WithRows<kMr>(rows, [&]<int R>() { MicroRows<R>(k_size, ap, bp, c, ldc, cols, accumulate); });
}

}  // namespace

const PackedKernels& Avx512Bf16PairKernels() {
  static const PackedKernels k{"avx512_bf16",
                               kMr,
                               kNr,
                               /*kb=*/512,
                               /*nb=*/2048,
                               /*mb=*/96,
                               /*pairs=*/true,
                               &PackAGeneric<kMr, true>,
                               &PackBPairs<kNr, 1>,
                               &Micro,
                               &SmallRows</*kRoundFp8=*/true>,
                               &SiluMulAvx2,
                               &SiluMulBackwardAvx2,
                               &StoreBf16RowAvx512};
  return k;
}

}  // namespace moefit::experts::kernels::internal
