// AVX-512 BF16 kernels (compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512bf16), used when B (the weight) is bfloat16 or FP8, in one of two
// forms chosen once per process by what this CPU runs faster (isa.h):
//   * bfloat16 pairs: a 12 x 32 microkernel on vdpbf16ps, which multiplies
//     two bfloat16 pairs per 32-bit lane and adds both products to a float32
//     accumulator -- twice the multiply-adds of a float32 FMA per
//     instruction. A is rounded to bfloat16 as it is packed, FP8 x scale too.
//   * widened: the avx512 kernels, packing the weights' bfloat16 values (FP8
//     x scale rounded to bfloat16, as above) widened exactly to float32, A
//     kept in float32. Where vdpbf16ps issues at a quarter of the FMA's rate
//     (an Emerald Rapids Xeon without AMX), this does twice the
//     multiply-adds per second.
// Both stream a few rows of A the same way (SmallRows<true>), so an FP8
// weight multiplies as its bfloat16 dequantization in either form.
#include <algorithm>
#include <chrono>
#include <limits>

#include "experts/kernels/internal/x86_intrinsics.h"

#define MOEFIT_PACK_WIDTH 16
#include "experts/kernels/internal/bf16_pairs.h"
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
  StoreTwoVectorRows<kRows>(acc0, acc1, c, ldc, cols, accumulate);
}

void Micro(int64_t k_size, const void* a_panel, const void* b_panel, float* c, int64_t ldc,
           int rows, int cols, bool accumulate) {
  const auto* ap = static_cast<const uint32_t*>(a_panel);
  const auto* bp = static_cast<const uint32_t*>(b_panel);
  WithRows<kMr>(rows, [&]<int R>() { MicroRows<R>(k_size, ap, bp, c, ldc, cols, accumulate); });
}

// kChains independent multiply-adds per iteration into as many accumulators
// (more than either instruction's latency times its issue rate, so only the
// issue rate counts), on an operand the compiler cannot see through: kPairs,
// vdpbf16ps (32 multiply-adds each); else vfmadd231ps (16).
template <bool kPairs>
__attribute__((noinline)) float IssueChains(int64_t iters) {
  constexpr int kChains = 24;
  // Distinct starts, or the compiler merges the identical chains into one.
  __m512 acc[kChains];
#pragma GCC unroll 24
  for (int r = 0; r < kChains; ++r) acc[r] = _mm512_set1_ps(static_cast<float>(r));
  // 1.0019... as float32, and two normal bfloat16 halves (no denormals).
  __m512 x = _mm512_castsi512_ps(_mm512_set1_epi32(0x3f803f80));
  for (int64_t i = 0; i < iters; ++i) {
    __asm__ volatile("" : "+v"(x));
#pragma GCC unroll 24
    for (int r = 0; r < kChains; ++r) {
      if constexpr (kPairs) {
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)x, (__m512bh)x);
      } else {
        acc[r] = _mm512_fmadd_ps(x, x, acc[r]);
      }
    }
  }
  __m512 sum = acc[0];
#pragma GCC unroll 24
  for (int r = 1; r < kChains; ++r) sum = _mm512_add_ps(sum, acc[r]);
  return _mm512_reduce_add_ps(sum);
}

template <bool kPairs>
double SecondsFor(int64_t iters, volatile float& sink) {
  const auto t0 = std::chrono::steady_clock::now();
  sink = IssueChains<kPairs>(iters);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

double MeasureBf16PairSpeed() {
  // Short rounds, the fastest of 16 interleaved ones, after one to wake the
  // vector units: a round slowed by an interrupt or a neighbour does not
  // count, and both kinds see the same moments of the machine.
  constexpr int64_t kFmaIters = 4096, kPairIters = 1024;
  volatile float sink = 0;
  SecondsFor<false>(kFmaIters, sink);
  SecondsFor<true>(kPairIters, sink);
  double fma = std::numeric_limits<double>::infinity(), pairs = fma;
  for (int round = 0; round < 16; ++round) {
    fma = std::min(fma, SecondsFor<false>(kFmaIters, sink));
    pairs = std::min(pairs, SecondsFor<true>(kPairIters, sink));
  }
  return (kPairIters * 32.0 / pairs) / (kFmaIters * 16.0 / fma);
}

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
                               &ExpSumAvx2,
                               &StoreBf16RowAvx512,
                               /*k_pad_pairs=*/1,
                               /*begin=*/nullptr,
                               /*end=*/nullptr,
                               &ExpandFp8Pairs<kNr, 1>};
  return k;
}

const PackedKernels& Avx512Bf16WidenedKernels() {
  static const PackedKernels k = [] {
    PackedKernels widened = Avx512F32Kernels();
    widened.name = "avx512_bf16 (widened)";
    widened.pack_b = &PackBF32<kAvx512F32Nr, /*kRoundFp8=*/true>;
    widened.small_rows = &SmallRows</*kRoundFp8=*/true>;
    return widened;
  }();
  return k;
}

}  // namespace moefit::experts::kernels::internal
