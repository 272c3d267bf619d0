// Vectorised operand loads and B packing for the x86 kernels. Included by the
// kernel file of each instruction set after defining MOEFIT_PACK_WIDTH (8 for
// AVX2, 16 for AVX-512); like pack_common.h, everything has internal linkage.
//
// B is the weight in the expert layer and is packed once per call for all
// rows, so its packing is the floor for small row blocks: it must run near
// memory speed. Two layouts matter:
//   n-contiguous (col_stride 1: W read as W, the dX GEMMs; x in dW): each
//     panel row is VL-wide vector loads, converted, stored;
//   k-contiguous (row_stride 1: W read as Wᵀ, the forward GEMMs): VL columns
//     x VL k-values are loaded, converted and transposed in registers.
// Anything else (tails, other strides) takes the generic path. An int4
// weight's elements are unpacked and scaled in registers, a vector at a time
// from one group (LoadI4), into the same panels its bfloat16 dequantization
// would give.
#pragma once

#include <cmath>
#include <utility>

#include "experts/kernels/internal/fp8_tables.h"
#include "experts/kernels/internal/pack_common.h"
#include "experts/kernels/internal/x86_intrinsics.h"

#ifndef MOEFIT_PACK_WIDTH
#error "define MOEFIT_PACK_WIDTH before including pack_x86.h"
#endif

namespace moefit::experts::kernels::internal {
namespace {

// e4m3 -> binary16, exact, subnormals included: the byte, sign-extended to 16
// bits and shifted left by 7, has e4m3's exponent and mantissa where
// binary16 keeps its own and the sign in bit 15; the mask clears the sign's
// other copies. Binary16's exponent bias is 8 more than e4m3's, so the value
// is the binary16's times 2^8. A byte whose seven low bits are all set (NaN)
// is, shifted left by 9, kF8NanHigh.
constexpr int16_t kF8ToHalfBits = static_cast<int16_t>(0xbf80);
constexpr int16_t kF8NanHigh = static_cast<int16_t>(0xfe00);

#if MOEFIT_PACK_WIDTH == 8
using VecF = __m256;
constexpr int kVl = 8;

inline void StoreF(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline VecF ZeroF() { return _mm256_setzero_ps(); }
// Each lane rounded to bfloat16 (nearest even, as F32ToBf16) and widened
// back; for finite values.
inline VecF RoundBf16F(VecF v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i sum = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(sum, _mm256_set1_epi32(-65536)));
}
inline VecF SetF(float x) { return _mm256_set1_ps(x); }
inline VecF FmaF(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF LoadPlainF(const float* p) { return _mm256_loadu_ps(p); }
inline float SumF(VecF v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// kVl e4m3 bytes starting at element `idx` of `data`, as float32 times
// `factor` (one rounding; see kF8ToHalfBits).
inline VecF LoadF8(const void* data, int64_t idx, float factor) {
  const __m128i w = _mm_cvtepi8_epi16(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(data) + idx)));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(kF8ToHalfBits));
  const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(factor * 256.0f));
  const __m128i nan = _mm_cmpeq_epi16(_mm_slli_epi16(w, 9), _mm_set1_epi16(kF8NanHigh));
  return _mm256_or_ps(f, _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan)));  // all ones: NaN
}

// An int4 group's scale and 8 + zero point in every lane, made once per
// group and used for each of its vectors.
struct I4Lanes {
  __m256 scale;
  __m256i bias;
};
inline I4Lanes LanesOf(I4Params p) {
  return {_mm256_set1_ps(p.scale), _mm256_set1_epi32(8 + p.zero)};
}

// kVl int4 elements from nibble `idx` (even) of `data`, all of one group:
// each nibble u as bfloat16((u - 8 - z) x scale), widened (I4Dequantize).
inline VecF LoadI4(const void* data, int64_t idx, const I4Lanes& g) {
  uint32_t word;
  std::memcpy(&word, static_cast<const uint8_t*>(data) + (idx >> 1), sizeof word);
  const __m128i bytes = _mm_cvtsi32_si128(static_cast<int>(word));
  // Each byte twice, then the low nibble of the first copy and the high one
  // of the second: element order.
  const __m256i u =
      _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes)),
                                         _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)),
                       _mm256_set1_epi32(0xf));
  const __m256 q = _mm256_cvtepi32_ps(_mm256_sub_epi32(u, g.bias));
  return RoundBf16F(_mm256_mul_ps(q, g.scale));
}

// kVl elements of type T starting at element `idx` of `data`, as float32.
template <ElemType T>
inline VecF LoadF(const void* data, int64_t idx) {
  static_assert(T != ElemType::kI4, "int4 elements are loaded with their group: LoadI4");
  if constexpr (T == ElemType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(data) + idx);
  } else if constexpr (T == ElemType::kBF16) {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(data) + idx));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return LoadF8(data, idx, 1.0f);
  }
}

// r[i] holds row i (kVl values); afterwards r[j] holds column j.
inline void Transpose(VecF r[kVl]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 2; ++g) {
    u[4 * g + 0] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
  }
}

// Stores (or adds, when accumulating) kRows rows of two 8-lane halves into
// C's first `cols` columns: whole rows directly, a partial block through a
// tile.
template <int kRows>
inline void StoreTwoVectorRows(__m256 acc0[], __m256 acc1[], float* c, int64_t ldc, int cols,
                               bool accumulate) {
  if (cols == 2 * kVl) {
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      float* row = c + r * ldc;
      if (accumulate) {
        acc0[r] = _mm256_add_ps(acc0[r], _mm256_loadu_ps(row));
        acc1[r] = _mm256_add_ps(acc1[r], _mm256_loadu_ps(row + kVl));
      }
      _mm256_storeu_ps(row, acc0[r]);
      _mm256_storeu_ps(row + kVl, acc1[r]);
    }
    return;
  }
  float tile[kRows * 2 * kVl];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_ps(tile + r * 2 * kVl, acc0[r]);
    _mm256_storeu_ps(tile + r * 2 * kVl + kVl, acc1[r]);
  }
  StoreTile<2 * kVl>(tile, c, ldc, kRows, cols, accumulate);
}

#else
using VecF = __m512;
constexpr int kVl = 16;

inline void StoreF(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline VecF ZeroF() { return _mm512_setzero_ps(); }
// Each lane rounded to bfloat16 (nearest even, as F32ToBf16) and widened
// back; for finite values.
inline VecF RoundBf16F(VecF v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(sum, _mm512_set1_epi32(-65536)));
}
inline VecF SetF(float x) { return _mm512_set1_ps(x); }
inline VecF FmaF(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF LoadPlainF(const float* p) { return _mm512_loadu_ps(p); }
inline float SumF(VecF v) { return _mm512_reduce_add_ps(v); }

inline VecF LoadF8(const void* data, int64_t idx, float factor) {
  const __m256i w = _mm256_cvtepi8_epi16(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(data) + idx)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(kF8ToHalfBits));
  const __mmask16 number =
      _mm256_cmpneq_epi16_mask(_mm256_slli_epi16(w, 9), _mm256_set1_epi16(kF8NanHigh));
  return _mm512_mask_mul_ps(_mm512_set1_ps(BitsToF32(0x7fc00000u)), number, _mm512_cvtph_ps(h),
                            _mm512_set1_ps(factor * 256.0f));
}

struct I4Lanes {
  __m512 scale;
  __m512i bias;
};
inline I4Lanes LanesOf(I4Params p) {
  return {_mm512_set1_ps(p.scale), _mm512_set1_epi32(8 + p.zero)};
}

inline VecF LoadI4(const void* data, int64_t idx, const I4Lanes& g) {
  uint64_t word;
  std::memcpy(&word, static_cast<const uint8_t*>(data) + (idx >> 1), sizeof word);
  const __m128i bytes = _mm_cvtsi64_si128(static_cast<long long>(word));
  const __m512i u = _mm512_and_si512(
      _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes)),
                        _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4)),
      _mm512_set1_epi32(0xf));
  const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(u, g.bias));
  return RoundBf16F(_mm512_mul_ps(q, g.scale));
}

template <ElemType T>
inline VecF LoadF(const void* data, int64_t idx) {
  static_assert(T != ElemType::kI4, "int4 elements are loaded with their group: LoadI4");
  if constexpr (T == ElemType::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(data) + idx);
  } else if constexpr (T == ElemType::kBF16) {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(data) + idx));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return LoadF8(data, idx, 1.0f);
  }
}

// Stores (or adds, when accumulating) kRows rows of two 16-lane halves into
// C's first `cols` columns, masking the tail.
template <int kRows>
inline void StoreTwoVectorRows(__m512 acc0[], __m512 acc1[], float* c, int64_t ldc, int cols,
                               bool accumulate) {
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

inline void Transpose(VecF r[kVl]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
    r[j] = _mm512_shuffle_f32x4(v0, w0, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + j] = _mm512_shuffle_f32x4(v0, w0, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + j] = _mm512_shuffle_f32x4(v1, w1, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + j] = _mm512_shuffle_f32x4(v1, w1, _MM_SHUFFLE(3, 1, 3, 1));
  }
}
#endif

// kVl elements of type T at `idx` as float32, times `s` for FP8 (its block
// scale), with one rounding.
template <ElemType T>
inline VecF LoadScaledF(const void* data, int64_t idx, float s) {
  if constexpr (T == ElemType::kF8E4M3) {
    return LoadF8(data, idx, s);
  } else {
    return LoadF<T>(data, idx);
  }
}

// kVl consecutive weight elements as float32 (times s for FP8), FP8 x s
// rounded to bfloat16 with kRoundFp8: the weight values of the sets that
// multiply bfloat16 (avx512_bf16, amx_bf16), widened.
template <ElemType T, bool kRoundFp8>
inline VecF LoadWeightF(const void* data, int64_t idx, float s) {
  VecF w = LoadScaledF<T>(data, idx, s);
  if constexpr (kRoundFp8 && T == ElemType::kF8E4M3) w = RoundBf16F(w);
  return w;
}

// kVl elements of B at `idx`, which lie in the scale block (or int4 group)
// of (k, j), as float32: FP8 x scale rounded to bfloat16 with kRoundFp8.
template <ElemType T, bool kRoundFp8>
inline VecF LoadWeightF(const Operand& b, int64_t idx, int64_t k, int64_t j) {
  if constexpr (T == ElemType::kI4) {
    return LoadI4(b.data, idx, LanesOf(I4ParamsAt(b, I4Group(b, k, j))));
  } else {
    return LoadWeightF<T, kRoundFp8>(b.data, idx, Scale<T>(b, k, j));
  }
}

// The lanes of int4 element (k, j)'s group, and where along `pos` (the
// nibbles' dimension, k or j) the next group starts: loops over vectors look
// a group up once, not per vector.
inline I4Lanes GroupLanes(const Operand& b, int64_t k, int64_t j, int64_t pos, int64_t extent,
                          int64_t& next_group) {
  next_group = (DivGroup(pos, extent) + 1) * extent;
  return LanesOf(I4ParamsAt(b, I4Group(b, k, j)));
}

// Whether B's vector loads along its contiguous dimension (kVl elements from
// a multiple of kVl) each lie in one group: always, but for an int4 B whose
// groups are not whole vectors, which then takes the scalar paths.
inline bool VectorsFitGroups(const Operand& b) {
  if (b.type != ElemType::kI4) return true;
  const int64_t along = b.col_stride == 1 ? b.group_cols : b.group_rows;
  return along % kVl == 0;
}

// The float32 microkernel of the AVX2 and AVX-512 sets (packed_kernels.h's
// micro): kRows <= kMr rows of an A panel times a B panel of two vectors of
// columns (nr = 2 kVl), one FMA per row and vector at each k. A block of at
// most kVl columns (a LoRA rank's) multiplies only the first vector.
template <int kMr, int kRows, bool kWide>
inline void MicroRowsF32(int64_t k_size, const float* ap, const float* bp, float* c, int64_t ldc,
                         int cols, bool accumulate) {
  constexpr int kNr = 2 * kVl;
  VecF acc0[kRows], acc1[kRows];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) acc0[r] = acc1[r] = ZeroF();
  for (int64_t k = 0; k < k_size; ++k) {
    const VecF b0 = LoadPlainF(bp + k * kNr);
    const VecF b1 = kWide ? LoadPlainF(bp + k * kNr + kVl) : b0;
    const float* a = ap + k * kMr;
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      const VecF av = SetF(a[r]);
      acc0[r] = FmaF(av, b0, acc0[r]);
      if constexpr (kWide) acc1[r] = FmaF(av, b1, acc1[r]);
    }
  }
  StoreTwoVectorRows<kRows>(acc0, acc1, c, ldc, cols, accumulate);
}

template <int kMr>
void MicroF32(int64_t k_size, const void* a_panel, const void* b_panel, float* c, int64_t ldc,
              int rows, int cols, bool accumulate) {
  const auto* ap = static_cast<const float*>(a_panel);
  const auto* bp = static_cast<const float*>(b_panel);
  WithRowsAndWidth<kMr>(rows, cols > kVl, [&]<int R, bool kWide>() {
    MicroRowsF32<kMr, R, kWide>(k_size, ap, bp, c, ldc, cols, accumulate);
  });
}

// Float32 B panels of kNr columns (see packed_kernels.h), vectorised for the
// two layouts above; with kRoundFp8, FP8 x scale rounded to bfloat16.
template <int kNr, bool kRoundFp8 = false>
void PackBF32(const Operand& b, int64_t k0, int64_t k_size, int64_t n0, int64_t n_size, void* out) {
  static_assert(kNr % kVl == 0);
  const int64_t panels = (n_size + kNr - 1) / kNr;
  const bool vectors = (b.col_stride == 1 || b.row_stride == 1) && VectorsFitGroups(b);
  DispatchType(b.type, [&]<ElemType T>() {
    // The kVl elements from `idx`, B(k, j) the first of them.
    auto load = [&](int64_t idx, int64_t k, int64_t j) {
      return LoadWeightF<T, kRoundFp8>(b, idx, k, j);
    };
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t col0 = n0 + p * kNr;
      const int64_t cols = MinI(kNr, n_size - p * kNr);
      float* o = static_cast<float*>(out) + p * k_size * kNr;
      if (cols < kNr || !vectors) {
        PackBGeneric<kNr, false, kRoundFp8>(b, k0, k_size, col0, cols, o);
        continue;
      }
      if (b.col_stride == 1) {
        for (int64_t k = 0; k < k_size; ++k) {
          const int64_t base = (k0 + k) * b.row_stride + col0;
          if constexpr (T == ElemType::kI4) {
            I4Lanes g;
            int64_t next_group = -1;
            for (int v = 0; v < kNr; v += kVl) {
              if (col0 + v >= next_group || v == 0) {
                g = GroupLanes(b, k0 + k, col0 + v, col0 + v, b.group_cols, next_group);
              }
              StoreF(o + k * kNr + v, LoadI4(b.data, base + v, g));
            }
          } else {
            for (int v = 0; v < kNr; v += kVl) {
              StoreF(o + k * kNr + v, load(base + v, k0 + k, col0 + v));
            }
          }
        }
        continue;
      }
      // k-contiguous: transpose kVl x kVl blocks. Chunks of kVl k-values
      // start at multiples of kVl from k0 (a multiple of the block size kb),
      // so each lies in one 128-row scale block (or int4 group).
      int64_t k = 0;
      // int4: the panel's columns' groups of the current run of k.
      [[maybe_unused]] I4Lanes groups[T == ElemType::kI4 ? kNr : 1];
      [[maybe_unused]] int64_t next_group = -1;
      for (; k + kVl <= k_size; k += kVl) {
        if constexpr (T == ElemType::kI4) {
          if (k0 + k >= next_group || k == 0) {
            for (int j = 0; j < kNr; ++j) {
              groups[j] = GroupLanes(b, k0 + k, col0 + j, k0 + k, b.group_rows, next_group);
            }
          }
        }
        for (int v = 0; v < kNr; v += kVl) {
          VecF r[kVl];
          for (int j = 0; j < kVl; ++j) {
            const int64_t idx = (col0 + v + j) * b.col_stride + k0 + k;
            if constexpr (T == ElemType::kI4) {
              r[j] = LoadI4(b.data, idx, groups[v + j]);
            } else {
              r[j] = load(idx, k0 + k, col0 + v + j);
            }
          }
          Transpose(r);
          for (int t = 0; t < kVl; ++t) StoreF(o + (k + t) * kNr + v, r[t]);
        }
      }
      if (k < k_size)
        PackBGeneric<kNr, false, kRoundFp8>(b, k0 + k, k_size - k, col0, kNr, o + k * kNr);
    }
  });
}

// The first `n` (< kVl) of kVl consecutive elements of type T as float32,
// the others zero; and a store of a vector's first `n` lanes.
template <ElemType T>
inline VecF LoadFirstF(const void* data, int64_t idx, int n) {
#if MOEFIT_PACK_WIDTH == 16
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (T == ElemType::kF32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(data) + idx);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(data) + idx);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#else
  alignas(32) float buf[kVl] = {};
  for (int i = 0; i < n; ++i) buf[i] = LoadAs<T>(data, idx + i);
  return _mm256_load_ps(buf);
#endif
}

inline void StoreFirstF(float* p, VecF v, int n) {
#if MOEFIT_PACK_WIDTH == 16
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
#else
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane), v);
#endif
}

// Float32 A panels of kMr < kVl rows (packed_kernels.h) from float32 or
// bfloat16 A, vectorised for the two layouts the expert layer uses: row-major
// (the activations: kVl x kVl blocks transposed in registers) and transposed
// (dYᵀ and xᵀ of the weight gradients: each k is a panel's rows in a run).
// The same values as PackAGeneric, which takes every other case.
template <int kMr>
void PackAF32(const Operand& a, int64_t m0, int64_t m_size, int64_t k0, int64_t k_size, void* out) {
  static_assert(kMr < kVl);
  if ((a.type != ElemType::kF32 && a.type != ElemType::kBF16) ||
      (a.col_stride != 1 && a.row_stride != 1)) {
    PackAGeneric<kMr, false>(a, m0, m_size, k0, k_size, out);
    return;
  }
  const int64_t panels = (m_size + kMr - 1) / kMr;
  DispatchType(a.type, [&]<ElemType T>() {
    if constexpr (!WeightOnly(T)) {
      for (int64_t p = 0; p < panels; ++p) {
        float* o = static_cast<float*>(out) + p * k_size * kMr;
        const int64_t row0 = m0 + p * kMr;
        const int rows = static_cast<int>(MinI(kMr, m_size - p * kMr));
        if (a.col_stride != 1) {  // transposed: column k holds the rows in a run
          for (int64_t k = 0; k < k_size; ++k) {
            StoreFirstF(o + k * kMr, LoadFirstF<T>(a.data, (k0 + k) * a.col_stride + row0, rows),
                        kMr);
          }
          continue;
        }
        int64_t k = 0;
        for (; k + kVl <= k_size; k += kVl) {
          VecF r[kVl];
          for (int i = 0; i < kVl; ++i) {
            r[i] = i < rows ? LoadF<T>(a.data, (row0 + i) * a.row_stride + k0 + k) : ZeroF();
          }
          Transpose(r);
          for (int t = 0; t < kVl; ++t) StoreFirstF(o + (k + t) * kMr, r[t], kMr);
        }
        for (; k < k_size; ++k) {
          for (int i = 0; i < kMr; ++i) {
            o[k * kMr + i] =
                i < rows ? LoadAs<T>(a.data, (row0 + i) * a.row_stride + k0 + k) : 0.0f;
          }
        }
      }
    }
  });
}

// Writes v into C[i, j] (float32 or bfloat16), adding to C when accumulating.
inline void StoreOut(const Output& c, int64_t i, int64_t j, float v, bool accumulate) {
  if (c.type == ElemType::kF32) {
    float* p = static_cast<float*>(c.data) + i * c.row_stride + j;
    *p = accumulate ? *p + v : v;
  } else {
    uint16_t* p = static_cast<uint16_t*>(c.data) + i * c.row_stride + j;
    *p = F32ToBf16(accumulate ? Bf16ToF32(*p) + v : v);
  }
}

template <ElemType T, bool kRoundFp8>
inline float WeightValue(const Operand& b, int64_t k, int64_t j) {
  const float w = ValueAs<T>(b, k, j);
  if constexpr (kRoundFp8 && T == ElemType::kF8E4M3) return Bf16ToF32(F32ToBf16(w));
  return w;
}

// A few rows of A (at most kMaxStreamedRows): the GEMM is a handful of
// matrix-vector products, bound by reading B (the weight) once. Packing B
// would read and write it once more, so here B is streamed straight from where
// it lies and converted in registers, as is A, in float32 (no bfloat16
// rounding of A on any instruction set). With kRoundFp8 (the kernels that
// multiply bfloat16 pairs), FP8 x scale is rounded to bfloat16 as their packs
// round it, so that an FP8 weight gives the same bits on this path as on the
// blocked one, and as its bfloat16 dequantization.
//
// The row count kM is a template argument (SmallRows dispatches on m), so the
// accumulators stay in registers with no per-row tests in the inner loops.
// Each element of C is summed in an order that depends on neither kM nor the
// column or k blocking, so a row's result does not depend on the rows that
// share its call; the scalar tails use std::fma, so that the compiler's
// choice to contract a multiply-add or not cannot differ between them.

// Asks for the line of element idx of `data` (of type T) ahead of its use;
// an address past the operand's end is harmless (no fault, no effect).
template <ElemType T>
inline void Prefetch(const void* data, int64_t idx) {
  constexpr int kBytes = T == ElemType::kF32 ? 4 : T == ElemType::kBF16 ? 2 : 1;
  const int64_t offset = T == ElemType::kI4 ? idx >> 1 : idx * kBytes;
  _mm_prefetch(static_cast<const char*>(data) + offset, _MM_HINT_T0);
}

// The end of StreamColumns' sums for columns [j0, j0 + kC): acc's lanes
// reduced, plus the products of k in [k_tail, k_size) summed in order, into C.
template <int kM, int kC, bool kRoundFp8, ElemType TA, ElemType T>
inline void StoreColumns(int64_t j0, int64_t k_tail, int64_t k_size, const Operand& a,
                         const Operand& b, const Output& c, bool accumulate,
                         const VecF (&acc)[kM][kC]) {
  float tail[kM][kC] = {};
  for (int64_t k = k_tail; k < k_size; ++k) {
    for (int j = 0; j < kC; ++j) {
      const float w = WeightValue<T, kRoundFp8>(b, k, j0 + j);
      for (int i = 0; i < kM; ++i) tail[i][j] = std::fma(ValueAs<TA>(a, i, k), w, tail[i][j]);
    }
  }
  for (int i = 0; i < kM; ++i) {
    for (int j = 0; j < kC; ++j) StoreOut(c, i, j0 + j, SumF(acc[i][j]) + tail[i][j], accumulate);
  }
}

// Columns [j_first, n) of C, fewer than one vector, scalar: each element one
// sum over k in order (StreamNContiguous' last columns).
template <int kM, bool kRoundFp8, ElemType TA, ElemType T>
inline void StoreLastColumns(int64_t j_first, int64_t n, int64_t k_size, const Operand& a,
                             const Operand& b, const Output& c, bool accumulate) {
  for (int i = 0; i < kM; ++i) {
    for (int64_t j = j_first; j < n; ++j) {
      float sum = 0.0f;
      for (int64_t k = 0; k < k_size; ++k) {
        sum = std::fma(ValueAs<TA>(a, i, k), WeightValue<T, kRoundFp8>(b, k, j), sum);
      }
      StoreOut(c, i, j, sum, accumulate);
    }
  }
}

// B(k, j) = data[j * col_stride + k]: column j is contiguous along k. kC
// columns [j0, j0 + kC) at a time: kM x kC vector accumulators over k, each
// reduced at the end, plus a scalar tail of k.
template <int kM, int kC, bool kRoundFp8, ElemType TA, ElemType T>
inline void StreamColumns(int64_t j0, int64_t k_size, const Operand& a, const Operand& b,
                          const Output& c, bool accumulate) {
  VecF acc[kM][kC];
  for (int i = 0; i < kM; ++i)
    for (int j = 0; j < kC; ++j) acc[i][j] = ZeroF();
  // int4: the columns' groups of the current run of k.
  [[maybe_unused]] I4Lanes groups[kC];
  [[maybe_unused]] int64_t next_group = -1;
  int64_t k = 0;
  for (; k + kVl <= k_size; k += kVl) {
    VecF x[kM];
    for (int i = 0; i < kM; ++i) x[i] = LoadF<TA>(a.data, i * a.row_stride + k);
    if constexpr (T == ElemType::kI4) {
      if (k >= next_group) {
        for (int j = 0; j < kC; ++j) {
          groups[j] = GroupLanes(b, k, j0 + j, k, b.group_rows, next_group);
        }
      }
    }
    for (int j = 0; j < kC; ++j) {
      // The next columns' rows asked for ahead (float32 streamed as fast
      // without, within noise, so not there).
      if constexpr (T != ElemType::kF32) Prefetch<T>(b.data, (j0 + kC + j) * b.col_stride + k);
      VecF w;
      if constexpr (T == ElemType::kI4) {
        w = LoadI4(b.data, (j0 + j) * b.col_stride + k, groups[j]);
      } else {
        w = LoadWeightF<T, kRoundFp8>(b, (j0 + j) * b.col_stride + k, k, j0 + j);
      }
      for (int i = 0; i < kM; ++i) acc[i][j] = FmaF(x[i], w, acc[i][j]);
    }
  }
  StoreColumns<kM, kC, kRoundFp8, TA, T>(j0, k, k_size, a, b, c, accumulate, acc);
}

template <int kM, bool kRoundFp8, ElemType TA, ElemType T>
void StreamKContiguous(int64_t n, int64_t k_size, const Operand& a, const Operand& b,
                       const Output& c, bool accumulate) {
  // Accumulators in at most three quarters of the vector registers.
  constexpr int kC = kVl == 16 ? (kM <= 4 ? 4 : 3) : (kM <= 4 ? 2 : 1);
  int64_t j0 = 0;
  for (; j0 + kC <= n; j0 += kC) {
    StreamColumns<kM, kC, kRoundFp8, TA, T>(j0, k_size, a, b, c, accumulate);
  }
  for (; j0 < n; ++j0) StreamColumns<kM, 1, kRoundFp8, TA, T>(j0, k_size, a, b, c, accumulate);
}

// acc[i][0, width) += sum over kK rows k0.. of A(i, k) * B(k, j0 + j), in k
// order (width a multiple of kVl).
template <int kM, int kK, int64_t kStrip, bool kRoundFp8, ElemType TA, ElemType T>
inline void AddRows(int64_t k0, int64_t j0, int64_t width, const Operand& a, const Operand& b,
                    float (&acc)[kM][kStrip]) {
  VecF x[kM][kK];
  for (int i = 0; i < kM; ++i)
    for (int kk = 0; kk < kK; ++kk) x[i][kk] = SetF(ValueAs<TA>(a, i, k0 + kk));
  const int64_t row = k0 * b.row_stride + j0;
  // int4: the rows' groups of the current run of columns.
  [[maybe_unused]] I4Lanes groups[kK];
  [[maybe_unused]] int64_t next_group = -1;
  for (int64_t j = 0; j < width; j += kVl) {
    if constexpr (T == ElemType::kI4) {
      if (j0 + j >= next_group) {
        for (int kk = 0; kk < kK; ++kk) {
          groups[kk] = GroupLanes(b, k0 + kk, j0 + j, j0 + j, b.group_cols, next_group);
        }
      }
    }
    VecF w[kK];
    for (int kk = 0; kk < kK; ++kk) {
      Prefetch<T>(b.data, row + (kK + kk) * b.row_stride + j);
      if constexpr (T == ElemType::kI4) {
        w[kk] = LoadI4(b.data, row + kk * b.row_stride + j, groups[kk]);
      } else {
        w[kk] = LoadWeightF<T, kRoundFp8>(b, row + kk * b.row_stride + j, k0 + kk, j0 + j);
      }
    }
    for (int i = 0; i < kM; ++i) {
      VecF sum = LoadPlainF(&acc[i][j]);
      for (int kk = 0; kk < kK; ++kk) sum = FmaF(x[i][kk], w[kk], sum);
      StoreF(&acc[i][j], sum);
    }
  }
}

// StreamNContiguous' loops: for each strip of kStrip columns (of whole
// vectors), acc zeroed, add_rows.template operator()<kK>(k, j0, width, acc)
// adding rows k.. k + kK - 1 of B into it -- kK rows at a time, each
// accumulator loaded and stored once per kK rows, then one at a time -- and
// acc written to C; then the last columns.
template <int kM, int64_t kStrip, bool kRoundFp8, ElemType TA, ElemType T, typename AddRowsFn>
inline void SumStrips(int64_t n, int64_t k_size, const Operand& a, const Operand& b,
                      const Output& c, bool accumulate, const AddRowsFn& add_rows) {
  constexpr int kK = kM * 4 <= kVl ? 4 : kM * 2 <= kVl ? 2 : 1;
  alignas(64) float acc[kM][kStrip];
  const int64_t full = n / kVl * kVl;
  for (int64_t j0 = 0; j0 < full; j0 += kStrip) {
    const int64_t width = MinI(kStrip, full - j0);
    for (int i = 0; i < kM; ++i)
      for (int64_t j = 0; j < width; ++j) acc[i][j] = 0.0f;
    int64_t k = 0;
    for (; k + kK <= k_size; k += kK) add_rows.template operator()<kK>(k, j0, width, acc);
    for (; k < k_size; ++k) add_rows.template operator()<1>(k, j0, width, acc);
    for (int i = 0; i < kM; ++i) {
      for (int64_t j = 0; j < width; ++j) StoreOut(c, i, j0 + j, acc[i][j], accumulate);
    }
  }
  StoreLastColumns<kM, kRoundFp8, TA, T>(full, n, k_size, a, b, c, accumulate);
}

// B(k, j) = data[k * row_stride + j]: row k is contiguous along j. Strips of
// up to kStrip columns: the kM rows of C for the strip stay in L1 (16 KiB)
// while B is read kK rows at a time, kStrip contiguous elements of each (long
// runs, as the prefetchers like), so each accumulator is loaded and stored
// once per kK rows of B.
template <int kM, bool kRoundFp8, ElemType TA, ElemType T>
void StreamNContiguous(int64_t n, int64_t k_size, const Operand& a, const Operand& b,
                       const Output& c, bool accumulate) {
  constexpr int64_t kStrip = 4096 / kM / kVl * kVl;
  SumStrips<kM, kStrip, kRoundFp8, TA, T>(
      n, k_size, a, b, c, accumulate,
      [&]<int kK>(int64_t k, int64_t j0, int64_t width, float(&acc)[kM][kStrip]) {
        AddRows<kM, kK, kStrip, kRoundFp8, TA, T>(k, j0, width, a, b, acc);
      });
}

// Runs fn.template operator()<kM>() for kM = m, 1 <= m <= kMaxRows.
template <int64_t kMaxRows = kMaxStreamedRows, typename Fn>
inline void DispatchRows(int64_t m, const Fn& fn) {
  [&]<int... kI>(std::integer_sequence<int, kI...>) {
    (void)((m == kI + 1 && (fn.template operator()<kI + 1>(), true)) || ...);
  }
  (std::make_integer_sequence<int, static_cast<int>(kMaxRows)>{});
}

// The streamed path for 1 <= m <= kMaxStreamedRows. Returns false, having
// done nothing, for layouts it does not take (A with strided columns, FP8 or
// int4; B with neither dimension contiguous, or an int4 B whose groups are
// not whole vectors). With kRoundFp8, an FP8 B goes through
// the lookup tables of fp8_tables.h where the CPU has them: the same bits.
template <bool kRoundFp8 = false>
bool SmallRows(int64_t m, int64_t n, int64_t k_size, const Operand& a, const Operand& b,
               const Output& c, bool accumulate) {
  if (m < 1 || m > kMaxStreamedRows || a.col_stride != 1 || WeightOnly(a.type) ||
      (b.row_stride != 1 && b.col_stride != 1) || !VectorsFitGroups(b)) {
    return false;
  }
  if constexpr (kRoundFp8) {
    if (b.type == ElemType::kF8E4M3 && Fp8TablesUsable() &&
        StreamFp8ByTables(m, n, k_size, a, b, c, accumulate)) {
      return true;
    }
  }
  DispatchType(a.type, [&]<ElemType TA>() {
    DispatchType(b.type, [&]<ElemType T>() {
      if constexpr (!WeightOnly(TA)) {
        DispatchRows(m, [&]<int kM>() {
          if (b.row_stride == 1) {
            StreamKContiguous<kM, kRoundFp8, TA, T>(n, k_size, a, b, c, accumulate);
          } else {
            StreamNContiguous<kM, kRoundFp8, TA, T>(n, k_size, a, b, c, accumulate);
          }
        });
      }
    });
  });
  return true;
}

}  // namespace
}  // namespace moefit::experts::kernels::internal
