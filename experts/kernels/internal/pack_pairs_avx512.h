// bfloat16-pair B panels for the AVX-512 BF16 and AMX-BF16 kernels (see
// packed_kernels.h), vectorised. Included by their kernel files after
// pack_x86.h with MOEFIT_PACK_WIDTH 16; internal linkage, like pack_common.h.
#pragma once

#include "experts/kernels/internal/pack_x86.h"
#include "experts/kernels/internal/x86_intrinsics.h"

namespace moefit::experts::kernels::internal {
namespace {

// 16 consecutive elements of type T (times s for FP8) rounded to bfloat16.
template <ElemType T>
inline __m256i LoadBf16(const void* data, int64_t idx, float s) {
  if constexpr (T == ElemType::kBF16) {
    return _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(data) + idx));
  } else {
    return (__m256i)_mm512_cvtneps_pbh(LoadScaledF<T>(data, idx, s));
  }
}

// The same for the 16 elements of B at `idx`, B(k, j) the first of them, in
// its scale block or int4 group (whose values are bfloat16 already).
template <ElemType T>
inline __m256i LoadBf16(const Operand& b, int64_t idx, int64_t k, int64_t j) {
  if constexpr (T == ElemType::kI4) {
    return (__m256i)_mm512_cvtneps_pbh(LoadWeightF<T, false>(b, idx, k, j));
  } else {
    return LoadBf16<T>(b.data, idx, Scale<T>(b, k, j));
  }
}

// bfloat16-pair B panels of kNr columns, vectorised for the n-contiguous
// layout (two rows interleaved) and the k-contiguous one (a column's pairs
// are consecutive 32-bit words: 16 x 16 word transposes); an FP8 B's whole
// panels through the lookup tables where the CPU has them (fp8_tables.h),
// up to the k they take. Each panel holds
// its pairs rounded up to a multiple of kPadPairs, the rows past the block
// zero (AMX multiplies whole 16-pair tiles).
template <int kNr, int kPadPairs>
void PackBPairs(const Operand& b, int64_t k0, int64_t k_size, int64_t n0, int64_t n_size,
                void* out) {
  static_assert(kNr == 32, "two 16-lane vectors per panel row");
  const int64_t panels = (n_size + kNr - 1) / kNr;
  const int64_t kp = (k_size + 1) / 2;
  const int64_t kp_padded = (kp + kPadPairs - 1) / kPadPairs * kPadPairs;
  const __m512i interleave =
      _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  // An FP8 B's whole panels through the lookup tables, up to table_k.
  int64_t table_panels = 0, table_k = 0;
  if (b.type == ElemType::kF8E4M3 && Fp8TablesUsable()) {
    table_panels = n_size / kNr;
    table_k = PackFp8PairsByTables(kPadPairs, b, k0, k_size, n0, table_panels, out);
    if (table_k == 0) table_panels = 0;
  }
  DispatchType(b.type, [&]<ElemType T>() {
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t col0 = n0 + p * kNr;
      const int64_t cols = MinI(kNr, n_size - p * kNr);
      const int64_t k_start = p < table_panels ? table_k : 0;
      uint32_t* o = static_cast<uint32_t*>(out) + p * kp_padded * kNr;
      std::memset(o + kp * kNr, 0, (kp_padded - kp) * kNr * sizeof(uint32_t));
      if (cols < kNr || (b.col_stride != 1 && b.row_stride != 1) || !VectorsFitGroups(b)) {
        PackBGeneric<kNr, true>(b, k0, k_size, col0, cols, o);
        continue;
      }
      if (b.col_stride == 1) {
        int64_t q = k_start / 2;
        for (; 2 * q + 1 < k_size; ++q) {
          const int64_t k = k0 + 2 * q;
          for (int v = 0; v < kNr; v += 16) {
            const __m256i lo = LoadBf16<T>(b, k * b.row_stride + col0 + v, k, col0 + v);
            const __m256i hi = LoadBf16<T>(b, (k + 1) * b.row_stride + col0 + v, k + 1, col0 + v);
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            _mm512_storeu_si512(o + q * kNr + v, _mm512_permutexvar_epi16(interleave, both));
          }
        }
        if (q < kp) PackBGeneric<kNr, true>(b, k0 + 2 * q, k_size - 2 * q, col0, kNr, o + q * kNr);
        continue;
      }
      // k-contiguous: chunks of 32 k-values (16 pairs), each half inside
      // one 128-row scale block (or int4 group).
      int64_t k = k_start;
      for (; k + 32 <= k_size; k += 32) {
        for (int v = 0; v < kNr; v += 16) {
          VecF r[16];
          for (int j = 0; j < 16; ++j) {
            const int64_t base = (col0 + v + j) * b.col_stride + k0 + k;
            const __m256i lo = LoadBf16<T>(b, base, k0 + k, col0 + v + j);
            const __m256i hi = LoadBf16<T>(b, base + 16, k0 + k + 16, col0 + v + j);
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

// PackedKernels::expand_fp8 for PackBPairs<kNr, kPadPairs>'s panels: each
// pair-row of a compact panel is kNr columns x (k, k + 1) bytes in the
// panel's order, inside one scale block, so it converts as four runs of 16
// through LoadBf16, as PackBPairs converts them -- or, where the CPU has
// them, through the FP8 lookup tables (fp8_tables.h), as SmallRows<true>
// streams its rows.
template <int kNr, int kPadPairs>
void ExpandFp8Pairs(const uint8_t* compact, const Operand& b, int64_t k0, int64_t k_size,
                    int64_t n0, int64_t n_size, void* out) {
  static_assert(kNr == 32, "four 16-byte runs per pair-row");
  if (Fp8TablesUsable()) {
    ExpandFp8PairsByTables(kPadPairs, compact, b, k0, k_size, n0, n_size, out);
    return;
  }
  constexpr ElemType kF8 = ElemType::kF8E4M3;
  const int64_t kp = k_size / 2;
  const int64_t kp_padded = (kp + kPadPairs - 1) / kPadPairs * kPadPairs;
  for (int64_t p = 0; p < (n_size + kNr - 1) / kNr; ++p) {
    const uint8_t* in = compact + p * kp_padded * kNr * 2;
    auto* o = static_cast<uint32_t*>(out) + p * kp_padded * kNr;
    for (int64_t q = 0; q < kp; ++q) {
      // A pack in memory (not cache) is read ahead of its expansion, which
      // the hardware prefetcher does not do across these strides.
      _mm_prefetch(reinterpret_cast<const char*>(in + (q + 32) * kNr * 2), _MM_HINT_T0);
      const float s = Scale<kF8>(b, k0 + 2 * q, n0 + p * kNr);
      for (int v = 0; v < 2 * kNr; v += 16) {
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(o + q * kNr) + v),
            LoadBf16<kF8>(in + q * kNr * 2, v, s));
      }
    }
    std::memset(o + kp * kNr, 0, (kp_padded - kp) * kNr * sizeof(uint32_t));
  }
}

}  // namespace
}  // namespace moefit::experts::kernels::internal
