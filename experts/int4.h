// 4-bit integer expert weights as compressed-tensors' pack-quantized format
// stores them (Kimi-K2-Thinking, Kimi-K2.5): the reference dequantization
// and a quantizer.
//
// An int4 weight [rows, cols] is kept as it is stored (ExpertWeights): bytes
// [rows, Int4RowBytes(cols)] holding two elements each, the low nibble first,
// each u = q + 8 for q in [-8, 7]; a bfloat16 scale per group of G
// consecutive columns of a row ([rows, ceil(cols / G)]); for asymmetric
// schemes an int8 zero point z per group. Element q stands for
// bfloat16((q - z) x scale): compressed-tensors dequantizes in the scale's
// dtype, and (q - z) x scale is exact in float32 before that one rounding.
// The expert kernels multiply by exactly these values, converting group by
// group as they go (kernels/gemm.h); DequantizeInt4 is the whole-tensor
// reference they are tested against, and what the eager backend and a merge
// into bfloat16 use.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace moefit::experts {

struct Int4Weight {
  at::Tensor bytes;       // [..., rows, Int4RowBytes(cols)] uint8
  at::Tensor scale;       // [..., rows, ceil(cols / G)] bfloat16
  at::Tensor zero_point;  // int8, as `scale`; undefined for a symmetric scheme
};

// The dequantized weight [..., rows, cols] in bfloat16 (exact in any wider
// dtype): plain ATen ops, the obviously correct reading of the format.
// Leading dimensions (experts) are carried through.
at::Tensor DequantizeInt4(const Int4Weight& w, int64_t group_size, int64_t cols);

// Quantizes `weight` ([..., rows, cols], floating) in groups of group_size
// columns, as compressed-tensors' min-max observer does: symmetric, scale =
// max |w| / 7.5 (rounded to bfloat16) and q = clamp(round(w / scale), -8, 7);
// asymmetric, the range [min(w, 0), max(w, 0)] over 15 steps with the zero
// point that puts min at -8. An all-zero group gets scale 1. For weights
// drawn at random where no checkpoint gives them (tests, benchmarks, a model
// started from scratch with frozen int4 experts).
Int4Weight QuantizeInt4(const at::Tensor& weight, int64_t group_size, bool symmetric = true);

}  // namespace moefit::experts
