// compressed-tensors checkpoints (Kimi-K2-Thinking, Kimi-K2.5, llm-compressor's
// outputs): what their quantized Linear weights look like on disk, and the
// int4 arithmetic the loader needs to read them.
//
// config.json's quantization_config (quant_method "compressed-tensors") maps
// module names to schemes; moefit reads two of them (launch/config.cc checks
// the rest away, naming the field):
//
//   pack-quantized, 4-bit integers in groups along the input dim. A Linear `X`
//   [out, in] is stored as
//     X.weight_packed      I32  [out, ceil(in / 8)]
//     X.weight_scale       BF16 (or F16, F32) [out, ceil(in / group_size)]
//     X.weight_shape       I32/I64 [2] = [out, in]
//     X.weight_zero_point  I32  [ceil(out / 8), ceil(in / group_size)]
//                          (asymmetric schemes only)
//   Element c of a row is nibble c of the row's little-endian bytes, low nibble
//   first, stored unsigned as q + 8 (q in [-8, 7]); the zero points are packed
//   the same way, but along the rows: word (w, g) holds rows 8w .. 8w + 7 of
//   group g. compressed-tensors' decompression computes
//     w = ((q - z) in the scale's dtype) * scale          (z = 0 when symmetric)
//   in the scale's dtype, so BF16 scales give BF16 values: the product is
//   rounded once, to the scale's dtype, whatever dtype the caller then wants.
//   Group g covers columns [g * group_size, (g + 1) * group_size).
//
//   float-quantized FP8 in blocks: `X.weight` F8_E4M3 [out, in] with
//   `X.weight_scale` [ceil(out / b0), ceil(in / b1)] -- the arithmetic of
//   DeepSeek-V3's `X.weight_scale_inv` (fp8.h) under another companion name.
//
// The loader (weight_loader.h) keeps packed int4 sources as they are for
// targets that want them (the expert kernels multiply the nibbles), or
// dequantizes them straight into floating targets with the function below,
// one matrix at a time.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"

namespace moefit::checkpoint {

// A pack-quantized int4 scheme: one scale (and, asymmetric, one zero point)
// per group_size consecutive inputs of each output row.
struct PackedInt4Format {
  int64_t group_size = 0;
  bool symmetric = true;
};

// `X.weight_packed` holds what `X.weight` would; the other companions are
// named after `X.weight` too.
inline constexpr std::string_view kPackedSuffix = "_packed";
inline constexpr std::string_view kShapeSuffix = "_shape";
inline constexpr std::string_view kZeroPointSuffix = "_zero_point";
// The scale of a pack-quantized int4 weight, and of a float-quantized FP8 one.
inline constexpr std::string_view kScaleSuffix = "_scale";

// Nibbles per int32 word.
inline constexpr int64_t kInt4PerWord = 8;

// int32 words of a packed row of `cols` values: ceil(cols / 8).
inline int64_t PackedInt4Words(int64_t cols) { return (cols + kInt4PerWord - 1) / kInt4PerWord; }
// Groups of `group_size` along a row of `cols` values.
inline int64_t NumInt4Groups(int64_t cols, int64_t group_size) {
  return (cols + group_size - 1) / group_size;
}

// Writes the dequantized `packed` (I32 [rows, ceil(cols / 8)], cols being
// dst's) into `dst` (2-D [rows, cols], any floating dtype, any strides) as
// compressed-tensors decompresses it: per group, float(q - z) * scale rounded
// to `scale`'s dtype (F32, BF16 or F16; [rows, ceil(cols / group_size)]), then
// converted to dst's dtype. `zero_point` is undefined for symmetric schemes,
// else I32 [ceil(rows / 8), groups]. Parallel over rows; reads the packed
// words in place, so a view of a file mapping costs no copy.
// InvalidArgument when a shape or dtype does not fit; callers add the tensor's name.
absl::Status DequantizePackedInt4Into(at::Tensor dst, const at::Tensor& packed,
                                      const at::Tensor& scale, const at::Tensor& zero_point,
                                      int64_t group_size);

// Unpacks zero points packed along the rows (I32 [ceil(rows / 8), groups])
// into `dst` (int8 [rows, groups], any strides): one signed value z in
// [-8, 7] per (row, group). InvalidArgument when the shapes or dtypes do not fit.
absl::Status UnpackInt4ZeroPointsInto(at::Tensor dst, const at::Tensor& packed);

}  // namespace moefit::checkpoint
