// Element conversions and the generic (scalar) packing, shared by every
// instruction set's kernels. Included only by the per-set kernel files, each
// compiled with its own target flags: everything here has internal linkage
// (anonymous namespace) so each file gets its own copy, built for its set.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "experts/kernels/gemm.h"

namespace moefit::experts::kernels::internal {
namespace {

inline int64_t MinI(int64_t a, int64_t b) { return a < b ? a : b; }

inline float BitsToF32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t F32ToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float Bf16ToF32(uint16_t b) { return BitsToF32(static_cast<uint32_t>(b) << 16); }

// Round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t F32ToBf16(float f) {
  const uint32_t u = F32ToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// out[j] = bfloat16(src[j]), or bfloat16(out[j] + src[j]) when accumulating:
// a float32 block's row written to a bfloat16 output.
inline void StoreBf16RowScalar(const float* src, uint16_t* out, int64_t n, bool accumulate) {
  for (int64_t j = 0; j < n; ++j)
    out[j] = F32ToBf16(accumulate ? Bf16ToF32(out[j]) + src[j] : src[j]);
}

// float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
// is subnormal (m / 8 * 2^-6). Exact. 0x7f / 0xff (NaN) read as NaN.
inline float F8ToF32(uint8_t b) {
  const uint32_t e = (b >> 3) & 0xfu, m = b & 0x7u;
  float v;
  if ((b & 0x7fu) == 0x7fu) {
    v = BitsToF32(0x7fc00000u);
  } else if (e == 0) {
    v = static_cast<float>(m) * (1.0f / 512.0f);
  } else {
    v = BitsToF32(((e + 120u) << 23) | (m << 20));
  }
  return (b & 0x80u) ? -v : v;
}

// The value of element `idx` of `data` for the types whose elements stand
// alone (int4 elements need their group: I4Value).
template <ElemType T>
inline float LoadAs(const void* data, int64_t idx) {
  static_assert(T != ElemType::kI4, "an int4 element's value needs its group: I4Value");
  if constexpr (T == ElemType::kF32) {
    return static_cast<const float*>(data)[idx];
  } else if constexpr (T == ElemType::kBF16) {
    return Bf16ToF32(static_cast<const uint16_t*>(data)[idx]);
  } else {
    return F8ToF32(static_cast<const uint8_t*>(data)[idx]);
  }
}

// x / g for g > 0, a shift where g is a power of two (the groups of
// published checkpoints: 1 x 32, 1 x 128), which the vector paths ask for
// once per vector.
inline int64_t DivGroup(int64_t x, int64_t g) {
  return (g & (g - 1)) == 0 ? x >> __builtin_ctzll(static_cast<uint64_t>(g)) : x / g;
}

// Where int4 element (i, j)'s group scale and zero point are (gemm.h's Operand).
inline int64_t I4Group(const Operand& op, int64_t i, int64_t j) {
  return DivGroup(i, op.group_rows) * op.scale_row_stride +
         DivGroup(j, op.group_cols) * op.scale_col_stride;
}

// An int4 group's scale (widened from bfloat16) and zero point.
struct I4Params {
  float scale;
  int zero;
};
inline I4Params I4ParamsAt(const Operand& op, int64_t g) {
  return {Bf16ToF32(op.group_scales[g]), op.zero_points != nullptr ? op.zero_points[g] : 0};
}

// bfloat16((q - z) x scale) as float32 for the nibble u = q + 8: exact in
// float32 before the one rounding (|q - z| < 2^5, the scale has 8 significant
// bits).
inline float I4Dequantize(uint32_t u, I4Params p) {
  return Bf16ToF32(F32ToBf16(static_cast<float>(static_cast<int>(u) - 8 - p.zero) * p.scale));
}

inline float I4Value(const Operand& op, int64_t i, int64_t j) {
  const int64_t idx = i * op.row_stride + j * op.col_stride;
  const uint32_t byte = static_cast<const uint8_t*>(op.data)[idx >> 1];
  return I4Dequantize((byte >> ((idx & 1) * 4)) & 0xfu, I4ParamsAt(op, I4Group(op, i, j)));
}

template <ElemType T>
inline float Scale(const Operand& op, int64_t i, int64_t j) {
  if constexpr (T == ElemType::kF8E4M3) {
    return op
        .scales[(i / kScaleBlock) * op.scale_row_stride + (j / kScaleBlock) * op.scale_col_stride];
  } else {
    return 1.0f;
  }
}

template <ElemType T>
inline float ValueAs(const Operand& op, int64_t i, int64_t j) {
  if constexpr (T == ElemType::kI4) {
    return I4Value(op, i, j);
  } else {
    const float v = LoadAs<T>(op.data, i * op.row_stride + j * op.col_stride);
    if constexpr (T == ElemType::kF8E4M3) return v * Scale<T>(op, i, j);
    return v;
  }
}

// Calls fn.template operator()<T>() for the operand's element type.
template <typename Fn>
inline void DispatchType(ElemType t, const Fn& fn) {
  switch (t) {
    case ElemType::kF32:
      fn.template operator()<ElemType::kF32>();
      break;
    case ElemType::kBF16:
      fn.template operator()<ElemType::kBF16>();
      break;
    case ElemType::kF8E4M3:
      fn.template operator()<ElemType::kF8E4M3>();
      break;
    case ElemType::kI4:
      fn.template operator()<ElemType::kI4>();
      break;
  }
}

// Generic A packing: rows [m0, m0 + m_size) x k [k0, k0 + k_size) into panels
// of kMr rows (see packed_kernels.h), any layout and element type.
template <int kMr, bool kPairs>
void PackAGeneric(const Operand& a, int64_t m0, int64_t m_size, int64_t k0, int64_t k_size,
                  void* out) {
  const int64_t panels = (m_size + kMr - 1) / kMr;
  const int64_t kp = (k_size + 1) / 2;
  if (a.col_stride == 1 && !WeightOnly(a.type)) {
    // Rows contiguous along k (activations, row-major): typed loops, one row
    // at a time, with no per-element index arithmetic or scales.
    DispatchType(a.type, [&]<ElemType T>() {
      if constexpr (!WeightOnly(T)) {
        for (int64_t p = 0; p < panels; ++p) {
          for (int r = 0; r < kMr; ++r) {
            const int64_t row = p * kMr + r;
            const bool inside = row < m_size;
            const int64_t base = (m0 + row) * a.row_stride + k0;
            if constexpr (kPairs) {
              uint32_t* o = static_cast<uint32_t*>(out) + p * kp * kMr + r;
              for (int64_t q = 0; q < kp; ++q) {
                uint32_t lo = 0, hi = 0;
                if (inside) {
                  if constexpr (T == ElemType::kBF16) {
                    const auto* src = static_cast<const uint16_t*>(a.data) + base;
                    lo = src[2 * q];
                    hi = 2 * q + 1 < k_size ? src[2 * q + 1] : 0u;
                  } else {
                    const auto* src = static_cast<const float*>(a.data) + base;
                    lo = F32ToBf16(src[2 * q]);
                    hi = 2 * q + 1 < k_size ? F32ToBf16(src[2 * q + 1]) : 0u;
                  }
                }
                o[q * kMr] = lo | (hi << 16);
              }
            } else {
              float* o = static_cast<float*>(out) + p * k_size * kMr + r;
              for (int64_t k = 0; k < k_size; ++k) {
                o[k * kMr] = inside ? LoadAs<T>(a.data, base + k) : 0.0f;
              }
            }
          }
        }
      }
    });
    return;
  }
  if (a.row_stride == 1 && !WeightOnly(a.type)) {
    // Columns contiguous along the rows (a transposed activation: dY or
    // d(gate|up) read as A of a weight gradient): each k gives a panel's rows
    // in a run.
    DispatchType(a.type, [&]<ElemType T>() {
      if constexpr (!WeightOnly(T)) {
        for (int64_t p = 0; p < panels; ++p) {
          const int64_t rows = MinI(kMr, m_size - p * kMr);
          auto at = [&](int64_t k, int r) {
            return LoadAs<T>(a.data, (k0 + k) * a.col_stride + m0 + p * kMr + r);
          };
          if constexpr (kPairs) {
            uint32_t* o = static_cast<uint32_t*>(out) + p * kp * kMr;
            for (int64_t q = 0; q < kp; ++q) {
              const bool has_hi = 2 * q + 1 < k_size;
              for (int r = 0; r < kMr; ++r) {
                uint32_t lo = 0, hi = 0;
                if (r < rows) {
                  lo = F32ToBf16(at(2 * q, r));
                  if (has_hi) hi = F32ToBf16(at(2 * q + 1, r));
                }
                o[q * kMr + r] = lo | (hi << 16);
              }
            }
          } else {
            float* o = static_cast<float*>(out) + p * k_size * kMr;
            for (int64_t k = 0; k < k_size; ++k) {
              for (int r = 0; r < kMr; ++r) o[k * kMr + r] = r < rows ? at(k, r) : 0.0f;
            }
          }
        }
      }
    });
    return;
  }
  DispatchType(a.type, [&]<ElemType T>() {
    for (int64_t p = 0; p < panels; ++p) {
      for (int r = 0; r < kMr; ++r) {
        const int64_t row = p * kMr + r;
        if constexpr (kPairs) {
          uint16_t* o = static_cast<uint16_t*>(out) + p * kp * kMr * 2 + r * 2;
          for (int64_t k = 0; k < 2 * kp; ++k) {
            const bool inside = row < m_size && k < k_size;
            o[(k / 2) * kMr * 2 + (k & 1)] =
                inside ? F32ToBf16(ValueAs<T>(a, m0 + row, k0 + k)) : uint16_t{0};
          }
        } else {
          float* o = static_cast<float*>(out) + p * k_size * kMr + r;
          for (int64_t k = 0; k < k_size; ++k) {
            o[k * kMr] = row < m_size ? ValueAs<T>(a, m0 + row, k0 + k) : 0.0f;
          }
        }
      }
    }
  });
}

// Generic B packing: k [k0, k0 + k_size) x columns [n0, n0 + n_size) into
// panels of kNr columns. Float32 panels with kRoundFp8 hold FP8 x scale
// rounded to bfloat16 (as pairs panels hold every element); int4 elements
// are bfloat16 values everywhere.
template <int kNr, bool kPairs, bool kRoundFp8 = false>
void PackBGeneric(const Operand& b, int64_t k0, int64_t k_size, int64_t n0, int64_t n_size,
                  void* out) {
  const int64_t panels = (n_size + kNr - 1) / kNr;
  const int64_t kp = (k_size + 1) / 2;
  DispatchType(b.type, [&]<ElemType T>() {
    for (int64_t p = 0; p < panels; ++p) {
      for (int j = 0; j < kNr; ++j) {
        const int64_t col = p * kNr + j;
        if constexpr (kPairs) {
          uint16_t* o = static_cast<uint16_t*>(out) + p * kp * kNr * 2 + j * 2;
          for (int64_t k = 0; k < 2 * kp; ++k) {
            const bool inside = col < n_size && k < k_size;
            o[(k / 2) * kNr * 2 + (k & 1)] =
                inside ? F32ToBf16(ValueAs<T>(b, k0 + k, n0 + col)) : uint16_t{0};
          }
        } else {
          float* o = static_cast<float*>(out) + p * k_size * kNr + j;
          for (int64_t k = 0; k < k_size; ++k) {
            float v = col < n_size ? ValueAs<T>(b, k0 + k, n0 + col) : 0.0f;
            if constexpr (kRoundFp8 && T == ElemType::kF8E4M3) v = Bf16ToF32(F32ToBf16(v));
            o[k * kNr] = v;
          }
        }
      }
    }
  });
}

// Calls fn.template operator()<R>() with R = rows, for rows in 1..kMax, so a
// microkernel's row count is a compile-time constant (its accumulators stay
// in registers).
template <int kMax, typename Fn>
inline void WithRows(int rows, const Fn& fn) {
  [&]<int... R>(std::integer_sequence<int, R...>) {
    (void)((rows == R + 1 ? (fn.template operator()<R + 1>(), true) : false) || ...);
  }
  (std::make_integer_sequence<int, kMax>());
}

// The same with a second constant, W = wide: a float32 microkernel whose
// panel is two vectors of columns runs only the first when the block's
// columns fit in it.
template <int kMax, typename Fn>
inline void WithRowsAndWidth(int rows, bool wide, const Fn& fn) {
  if (wide) {
    WithRows<kMax>(rows, [&]<int R>() { fn.template operator()<R, true>(); });
  } else {
    WithRows<kMax>(rows, [&]<int R>() { fn.template operator()<R, false>(); });
  }
}

// Writes a finished kMr x kNr float32 tile (row stride kNr) into C's first
// rows x cols, adding to C when accumulating.
template <int kNr>
inline void StoreTile(const float* tile, float* c, int64_t ldc, int rows, int cols,
                      bool accumulate) {
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < cols; ++j) {
      c[r * ldc + j] = accumulate ? c[r * ldc + j] + tile[r * kNr + j] : tile[r * kNr + j];
    }
  }
}

}  // namespace
}  // namespace moefit::experts::kernels::internal
