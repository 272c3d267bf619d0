// AVX-512 BF16 kernels (compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512bf16): a 12 x 32 microkernel on bfloat16 pairs with vdpbf16ps, which
// multiplies two bfloat16 pairs per 32-bit lane and adds both products to a
// float32 accumulator -- twice the multiply-adds of a float32 FMA per
// instruction. Used when B (the weight) is bfloat16 or FP8: A is rounded to
// bfloat16 as it is packed, FP8 x scale too.
#include <immintrin.h>

#define MOEFIT_PACK_WIDTH 16
#include "experts/kernels/internal/pack_x86.h"
#include "experts/kernels/internal/packed_kernels.h"
#include "experts/kernels/internal/swiglu_avx2.h"

namespace moefit::experts::kernels::internal {
namespace {

constexpr int kMr = 12;
constexpr int kNr = 32;

// 16 consecutive elements of type T (times s for FP8) rounded to bfloat16.
template <ElemType T>
inline __m256i LoadBf16(const void* data, int64_t idx, float s) {
  if constexpr (T == ElemType::kBF16) {
    return _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(data) + idx));
  } else {
    VecF x = LoadF<T>(data, idx);
    if constexpr (T == ElemType::kF8E4M3) x = MulS(x, s);
    return (__m256i)_mm512_cvtneps_pbh(x);
  }
}

// bfloat16-pair B panels (see packed_kernels.h), vectorised for the
// n-contiguous layout (two rows interleaved) and the k-contiguous one (a
// column's pairs are consecutive 32-bit words: 16 x 16 word transposes).
void PackBPairs(const Operand& b, int64_t k0, int64_t k_size, int64_t n0, int64_t n_size,
                void* out) {
  const int64_t panels = (n_size + kNr - 1) / kNr;
  const int64_t kp = (k_size + 1) / 2;
  const __m512i interleave =
      _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  DispatchType(b.type, [&]<ElemType T>() {
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t col0 = n0 + p * kNr;
      const int64_t cols = MinI(kNr, n_size - p * kNr);
      uint32_t* o = static_cast<uint32_t*>(out) + p * kp * kNr;
      if (cols < kNr || (b.col_stride != 1 && b.row_stride != 1)) {
        PackBGeneric<kNr, true>(b, k0, k_size, col0, cols, o);
        continue;
      }
      if (b.col_stride == 1) {
        int64_t q = 0;
        for (; 2 * q + 1 < k_size; ++q) {
          const int64_t k = k0 + 2 * q;
          const float s0 = Scale<T>(b, k, col0), s1 = Scale<T>(b, k + 1, col0);
          for (int v = 0; v < kNr; v += 16) {
            const __m256i lo = LoadBf16<T>(b.data, k * b.row_stride + col0 + v, s0);
            const __m256i hi = LoadBf16<T>(b.data, (k + 1) * b.row_stride + col0 + v, s1);
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            _mm512_storeu_si512(o + q * kNr + v, _mm512_permutexvar_epi16(interleave, both));
          }
        }
        if (q < kp) PackBGeneric<kNr, true>(b, k0 + 2 * q, k_size - 2 * q, col0, kNr, o + q * kNr);
        continue;
      }
      // k-contiguous: chunks of 32 k-values (16 pairs), each inside one
      // 128-row scale block.
      int64_t k = 0;
      for (; k + 32 <= k_size; k += 32) {
        for (int v = 0; v < kNr; v += 16) {
          const float s = Scale<T>(b, k0 + k, col0 + v);
          VecF r[16];
          for (int j = 0; j < 16; ++j) {
            const int64_t base = (col0 + v + j) * b.col_stride + k0 + k;
            const __m256i lo = LoadBf16<T>(b.data, base, s);
            const __m256i hi = LoadBf16<T>(b.data, base + 16, s);
            r[j] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
          }
          Transpose(r);
          for (int t = 0; t < 16; ++t) {
            _mm512_storeu_ps(reinterpret_cast<float*>(o + (k / 2 + t) * kNr + v), r[t]);
          }
        }
      }
      if (k < k_size) PackBGeneric<kNr, true>(b, k0 + k, k_size - k, col0, kNr, o + (k / 2) * kNr);
    }
  });
}

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
                               &PackBPairs,
                               &Micro,
                               &SmallRowsUpTo8,
                               &SiluMulAvx2,
                               &SiluMulBackwardAvx2};
  return k;
}

}  // namespace moefit::experts::kernels::internal
