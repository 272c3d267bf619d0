// Pack-quantized int4 arithmetic (see compressed_tensors.h).
//
// Each (row, group) has one scale and one zero point, so its 16 possible
// values are computed once -- float(q - z) * scale, rounded to the scale's
// dtype, then converted to the destination's, exactly the library's sequence
// of torch ops -- and the group's nibbles index that table. The nibbles are
// read from the row's bytes (safetensors data is little-endian, as are the
// hosts moefit runs on), low nibble first.
#include "checkpoint/compressed_tensors.h"

#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/internal/shapes.h"

namespace moefit::checkpoint {
namespace {

// Rows handed to one task: a few hundred KB of packed words at Kimi-K2's sizes.
constexpr int64_t kRowsPerTask = 16;

using internal::ShapeString;

// The stored (unsigned, q + 8) nibble `idx` of a row of bytes.
inline int Nibble(const uint8_t* bytes, int64_t idx) {
  return (bytes[idx >> 1] >> ((idx & 1) * 4)) & 0xF;
}

// Rows [row_begin, row_end) into `out` (element (r, c) at out[r * stride0 + c * stride1]).
template <typename Scale, typename Out>
void DequantizeRows(const uint8_t* packed, int64_t row_bytes, const Scale* scale,
                    int64_t num_groups, const int32_t* zero_point, int64_t cols, int64_t group_size,
                    Out* out, int64_t stride0, int64_t stride1, int64_t row_begin,
                    int64_t row_end) {
  std::array<Out, 16> values;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* in = packed + r * row_bytes;
    Out* out_row = out + r * stride0;
    for (int64_t g = 0; g < num_groups; ++g) {
      const float s = static_cast<float>(scale[r * num_groups + g]);
      // Both q and z are stored + 8, so q - z is the difference of the nibbles.
      const int z =
          zero_point == nullptr
              ? 8
              : (zero_point[(r / kInt4PerWord) * num_groups + g] >> ((r % kInt4PerWord) * 4)) & 0xF;
      for (int nibble = 0; nibble < 16; ++nibble) {
        // q - z is exact in any float dtype; the product is rounded once, to
        // the scale's dtype, as the library's `(q - z).to(scale.dtype) * scale`.
        const Scale value = static_cast<Scale>(static_cast<float>(nibble - z) * s);
        values[nibble] = static_cast<Out>(static_cast<float>(value));
      }
      const int64_t c_end = std::min(cols, (g + 1) * group_size);
      for (int64_t c = g * group_size; c < c_end; ++c) {
        out_row[c * stride1] = values[Nibble(in, c)];
      }
    }
  }
}

}  // namespace

absl::Status DequantizePackedInt4Into(at::Tensor dst, const at::Tensor& packed,
                                      const at::Tensor& scale, const at::Tensor& zero_point,
                                      int64_t group_size) {
  if (group_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("int4 group size must be positive, got ", group_size));
  }
  if (dst.dim() != 2 || !at::isFloatingType(dst.scalar_type())) {
    return absl::InvalidArgumentError(
        absl::StrCat("int4 dequantization writes a 2-D floating tensor, not ",
                     c10::toString(dst.scalar_type()), " ", ShapeString(dst.sizes())));
  }
  const int64_t rows = dst.size(0);
  const int64_t cols = dst.size(1);
  const int64_t num_groups = NumInt4Groups(cols, group_size);
  if (packed.scalar_type() != at::kInt ||
      packed.sizes() != at::IntArrayRef({rows, PackedInt4Words(cols)})) {
    return absl::InvalidArgumentError(
        absl::StrCat("packed int4 weight is ", c10::toString(packed.scalar_type()), " ",
                     ShapeString(packed.sizes()), ", a [", rows, ", ", cols, "] weight needs Int [",
                     rows, ", ", PackedInt4Words(cols), "]"));
  }
  const at::ScalarType scale_type = scale.scalar_type();
  if ((scale_type != at::kFloat && scale_type != at::kBFloat16 && scale_type != at::kHalf) ||
      scale.sizes() != at::IntArrayRef({rows, num_groups})) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale is ", c10::toString(scale_type), " ", ShapeString(scale.sizes()),
                     ", a [", rows, ", ", cols, "] weight in groups of ", group_size,
                     " needs Float, BFloat16 or Half [", rows, ", ", num_groups, "]"));
  }
  if (zero_point.defined() &&
      (zero_point.scalar_type() != at::kInt ||
       zero_point.sizes() != at::IntArrayRef({PackedInt4Words(rows), num_groups}))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "zero point is ", c10::toString(zero_point.scalar_type()), " ",
        ShapeString(zero_point.sizes()), ", a [", rows, ", ", cols, "] weight in groups of ",
        group_size, " needs Int [", PackedInt4Words(rows), ", ", num_groups, "]"));
  }
  if (!dst.is_cpu() || !packed.is_cpu()) {
    return absl::InvalidArgumentError("int4 dequantization runs on CPU tensors");
  }
  try {
    const at::Tensor p = packed.contiguous();  // a no-op for a mapping view
    const at::Tensor s = scale.contiguous();
    const at::Tensor z = zero_point.defined() ? zero_point.contiguous() : at::Tensor();
    const auto* p_data = static_cast<const uint8_t*>(p.const_data_ptr());
    const int64_t row_bytes = PackedInt4Words(cols) * 4;
    const int32_t* z_data = z.defined() ? z.const_data_ptr<int32_t>() : nullptr;
    auto run = [&](const auto* s_data, auto* out, const at::Tensor& target) {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, rows, kRowsPerTask),
                        [&](const tbb::blocked_range<int64_t>& range) {
                          DequantizeRows(p_data, row_bytes, s_data, num_groups, z_data, cols,
                                         group_size, out, target.stride(0), target.stride(1),
                                         range.begin(), range.end());
                        });
    };
    auto with_scale = [&](auto* out, const at::Tensor& target) {
      switch (scale_type) {
        case at::kFloat:
          run(s.const_data_ptr<float>(), out, target);
          break;
        case at::kBFloat16:
          run(s.const_data_ptr<c10::BFloat16>(), out, target);
          break;
        default:
          run(s.const_data_ptr<c10::Half>(), out, target);
          break;
      }
    };
    switch (dst.scalar_type()) {
      case at::kFloat:
        with_scale(dst.data_ptr<float>(), dst);
        return absl::OkStatus();
      case at::kBFloat16:
        with_scale(dst.data_ptr<c10::BFloat16>(), dst);
        return absl::OkStatus();
      case at::kHalf:
        with_scale(dst.data_ptr<c10::Half>(), dst);
        return absl::OkStatus();
      default: {
        // Rare targets (fp64, ...): every value is exact in fp32, then torch's conversion.
        at::Tensor wide = at::empty({rows, cols}, at::TensorOptions().dtype(at::kFloat));
        with_scale(wide.data_ptr<float>(), wide);
        dst.copy_(wide);
        return absl::OkStatus();
      }
    }
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("int4 dequantization: ", e.what_without_backtrace()));
  }
}

absl::Status UnpackInt4ZeroPointsInto(at::Tensor dst, const at::Tensor& packed) {
  if (dst.dim() != 2 || dst.scalar_type() != at::kChar) {
    return absl::InvalidArgumentError(
        absl::StrCat("int4 zero points unpack into a 2-D Char tensor, not ",
                     c10::toString(dst.scalar_type()), " ", ShapeString(dst.sizes())));
  }
  const int64_t rows = dst.size(0);
  const int64_t num_groups = dst.size(1);
  if (packed.scalar_type() != at::kInt ||
      packed.sizes() != at::IntArrayRef({PackedInt4Words(rows), num_groups})) {
    return absl::InvalidArgumentError(
        absl::StrCat("packed zero points are ", c10::toString(packed.scalar_type()), " ",
                     ShapeString(packed.sizes()), ", [", rows, ", ", num_groups,
                     "] zero points need Int [", PackedInt4Words(rows), ", ", num_groups, "]"));
  }
  try {
    const at::Tensor p = packed.contiguous();
    const int32_t* words = p.const_data_ptr<int32_t>();
    int8_t* out = dst.data_ptr<int8_t>();
    const int64_t stride0 = dst.stride(0), stride1 = dst.stride(1);
    for (int64_t r = 0; r < rows; ++r) {
      const int shift = static_cast<int>(r % kInt4PerWord) * 4;
      for (int64_t g = 0; g < num_groups; ++g) {
        const int nibble = (words[(r / kInt4PerWord) * num_groups + g] >> shift) & 0xF;
        out[r * stride0 + g * stride1] = static_cast<int8_t>(nibble - 8);
      }
    }
    return absl::OkStatus();
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("int4 zero points: ", e.what_without_backtrace()));
  }
}

}  // namespace moefit::checkpoint
