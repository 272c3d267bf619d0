// Block-scaled FP8 dequantization (see fp8.h).
//
// The fast path converts each FP8 byte through a 256-entry table built once per
// dtype by torch's own conversion, so its values are torch's by construction;
// the multiply is one fp32 multiply, and the store converts with c10's scalar
// types (round to nearest even, as at::Tensor::to does), so the result is bit
// for bit the reference's.
#include "checkpoint/fp8.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <array>
#include <string>

#include "absl/strings/str_cat.h"
#include "checkpoint/internal/shapes.h"

namespace moefit::checkpoint {
namespace {

using Lut = std::array<float, 256>;

using internal::ShapeString;

// The fp32 value of every byte of an FP8 dtype, by torch's conversion.
Lut BuildLut(at::ScalarType type) {
  const at::Tensor values =
      at::arange(256, at::TensorOptions().dtype(at::kInt)).to(at::kByte).view(type).to(at::kFloat);
  Lut lut;
  std::copy_n(values.const_data_ptr<float>(), lut.size(), lut.begin());
  return lut;
}

const Lut& LutFor(at::ScalarType type) {
  // Function-local statics: built on first use, thread-safe.
  switch (type) {
    case at::kFloat8_e4m3fn: {
      static const Lut lut = BuildLut(type);
      return lut;
    }
    case at::kFloat8_e5m2: {
      static const Lut lut = BuildLut(type);
      return lut;
    }
    case at::kFloat8_e4m3fnuz: {
      static const Lut lut = BuildLut(type);
      return lut;
    }
    default: {
      static const Lut lut = BuildLut(at::kFloat8_e5m2fnuz);
      return lut;
    }
  }
}

// Shapes and dtypes of one dequantization; the message says what does not fit.
absl::Status Check(const at::Tensor& weight, const at::Tensor& scale_inv,
                   std::array<int64_t, 2> block) {
  if (block[0] <= 0 || block[1] <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 block size must be positive, got [", block[0], ", ", block[1], "]"));
  }
  if (!IsFp8Dtype(weight.scalar_type())) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight has dtype ", c10::toString(weight.scalar_type()), ", not FP8"));
  }
  if (weight.dim() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("block-scaled FP8 weights are 2-D, this one is ",
                                                   ShapeString(weight.sizes())));
  }
  const std::vector<int64_t> want = BlockScaleShape(weight.sizes(), block);
  if (scale_inv.sizes() != at::IntArrayRef(want)) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale_inv has shape ", ShapeString(scale_inv.sizes()), ", a weight of ",
                     ShapeString(weight.sizes()), " in blocks of [", block[0], ", ", block[1],
                     "] needs ", ShapeString(want)));
  }
  return absl::OkStatus();
}

// Rows [row_begin, row_end) of the weight into `out` (element (r, c) at
// out[r * out_stride0 + c * out_stride1]).
template <typename Out>
void DequantizeRows(const uint8_t* weight, const float* scales, const Lut& lut, int64_t cols,
                    int64_t num_col_blocks, std::array<int64_t, 2> block, Out* out,
                    int64_t out_stride0, int64_t out_stride1, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* in_row = weight + r * cols;
    const float* scale_row = scales + (r / block[0]) * num_col_blocks;
    Out* out_row = out + r * out_stride0;
    for (int64_t col_block = 0; col_block < num_col_blocks; ++col_block) {
      const float scale = scale_row[col_block];
      const int64_t c_end = std::min(cols, (col_block + 1) * block[1]);
      for (int64_t c = col_block * block[1]; c < c_end; ++c) {
        out_row[c * out_stride1] = static_cast<Out>(lut[in_row[c]] * scale);
      }
    }
  }
}

}  // namespace

bool IsFp8Dtype(Dtype dtype) {
  return dtype == Dtype::kF8E4M3 || dtype == Dtype::kF8E5M2 || dtype == Dtype::kF8E4M3Fnuz ||
         dtype == Dtype::kF8E5M2Fnuz;
}

bool IsFp8Dtype(at::ScalarType type) {
  return type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2 || type == at::kFloat8_e4m3fnuz ||
         type == at::kFloat8_e5m2fnuz;
}

bool IsScaleDtype(Dtype dtype) {
  return dtype == Dtype::kF32 || dtype == Dtype::kBF16 || dtype == Dtype::kF16 ||
         dtype == Dtype::kF8E8M0;
}

std::vector<int64_t> BlockScaleShape(at::IntArrayRef weight_shape, std::array<int64_t, 2> block) {
  std::vector<int64_t> shape;
  for (size_t dim = 0; dim < weight_shape.size() && dim < 2; ++dim) {
    shape.push_back((weight_shape[dim] + block[dim] - 1) / block[dim]);
  }
  return shape;
}

absl::Status DequantizeBlockFp8Into(at::Tensor dst, const at::Tensor& weight,
                                    const at::Tensor& scale_inv, std::array<int64_t, 2> block) {
  if (absl::Status ok = Check(weight, scale_inv, block); !ok.ok()) return ok;
  if (!dst.is_cpu() || !weight.is_cpu()) {
    return absl::InvalidArgumentError("FP8 dequantization runs on CPU tensors");
  }
  if (dst.sizes() != weight.sizes()) {
    return absl::InvalidArgumentError(absl::StrCat("destination has shape ",
                                                   ShapeString(dst.sizes()), ", the weight ",
                                                   ShapeString(weight.sizes())));
  }
  try {
    const at::Tensor w = weight.contiguous();  // a no-op for a mapping view
    const at::Tensor s = scale_inv.to(at::kFloat).contiguous();
    const Lut& lut = LutFor(w.scalar_type());
    const auto* w_data = static_cast<const uint8_t*>(w.const_data_ptr());
    const float* s_data = s.const_data_ptr<float>();
    const int64_t rows = w.size(0);
    const int64_t cols = w.size(1);
    const int64_t num_row_blocks = s.size(0);
    const int64_t num_col_blocks = s.size(1);
    // One task per row block: each reads its own scale row and writes its own rows.
    auto run = [&](auto* out, const at::Tensor& target) {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, num_row_blocks),
                        [&](const tbb::blocked_range<int64_t>& range) {
                          DequantizeRows(w_data, s_data, lut, cols, num_col_blocks, block, out,
                                         target.stride(0), target.stride(1),
                                         range.begin() * block[0],
                                         std::min(rows, range.end() * block[0]));
                        });
    };
    switch (dst.scalar_type()) {
      case at::kFloat:
        run(dst.data_ptr<float>(), dst);
        return absl::OkStatus();
      case at::kBFloat16:
        run(dst.data_ptr<c10::BFloat16>(), dst);
        return absl::OkStatus();
      case at::kHalf:
        run(dst.data_ptr<c10::Half>(), dst);
        return absl::OkStatus();
      default: {
        // Rare targets (fp64, ...): through an fp32 buffer, then torch's conversion.
        at::Tensor wide = at::empty(w.sizes(), at::TensorOptions().dtype(at::kFloat));
        run(wide.data_ptr<float>(), wide);
        dst.copy_(wide);
        return absl::OkStatus();
      }
    }
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 dequantization: ", e.what_without_backtrace()));
  }
}

absl::StatusOr<at::Tensor> DequantizeBlockFp8Reference(const at::Tensor& weight,
                                                       const at::Tensor& scale_inv,
                                                       std::array<int64_t, 2> block,
                                                       at::ScalarType dtype) {
  if (absl::Status ok = Check(weight, scale_inv, block); !ok.ok()) return ok;
  try {
    const int64_t rows = weight.size(0);
    const int64_t cols = weight.size(1);
    const at::Tensor scale = scale_inv.to(at::kFloat)
                                 .repeat_interleave(block[0], 0)
                                 .repeat_interleave(block[1], 1)
                                 .narrow(0, 0, rows)
                                 .narrow(1, 0, cols);
    return (weight.to(at::kFloat) * scale).to(dtype);
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 dequantization: ", e.what_without_backtrace()));
  }
}

absl::StatusOr<std::pair<at::Tensor, at::Tensor>> QuantizeBlockFp8(const at::Tensor& weight,
                                                                   std::array<int64_t, 2> block) {
  if (block[0] <= 0 || block[1] <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 block size must be positive, got [", block[0], ", ", block[1], "]"));
  }
  if (weight.dim() != 2 && weight.dim() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 quantization takes 2-D weights or [E, rows, cols] stacks, this one is ",
                     ShapeString(weight.sizes())));
  }
  if (!at::isFloatingType(weight.scalar_type()) || IsFp8Dtype(weight.scalar_type())) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 quantization of a ", c10::toString(weight.scalar_type()), " weight"));
  }
  constexpr double kE4m3Max = 448.0;
  try {
    const bool stacked = weight.dim() == 3;
    const at::Tensor w = (stacked ? weight : weight.unsqueeze(0)).to(at::kFloat);
    const int64_t rows = w.size(1), cols = w.size(2);
    const std::vector<int64_t> grid = BlockScaleShape({rows, cols}, block);
    // Zero-padded to whole blocks: [E, row blocks, B0, column blocks, B1].
    const at::Tensor padded =
        at::constant_pad_nd(w, {0, grid[1] * block[1] - cols, 0, grid[0] * block[0] - rows});
    const at::Tensor amax =
        padded.view({w.size(0), grid[0], block[0], grid[1], block[1]}).abs().amax({2, 4});
    const at::Tensor scale = at::where(amax > 0, amax / kE4m3Max, at::ones_like(amax));
    const at::Tensor full = scale.repeat_interleave(block[0], 1)
                                .repeat_interleave(block[1], 2)
                                .narrow(1, 0, rows)
                                .narrow(2, 0, cols);
    at::Tensor fp8 = (w / full).clamp(-kE4m3Max, kE4m3Max).to(at::kFloat8_e4m3fn);
    if (!stacked) return std::make_pair(fp8.squeeze(0), scale.squeeze(0));
    return std::make_pair(std::move(fp8), scale);
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 quantization: ", e.what_without_backtrace()));
  }
}

}  // namespace moefit::checkpoint
