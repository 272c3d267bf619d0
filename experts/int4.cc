// The int4 reference dequantization and quantizer; see int4.h.
#include "experts/int4.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "experts/expert_backend.h"

namespace moefit::experts {
namespace {

// [..., rows, n] -> [..., rows, ceil(n / group) * group], zeros appended.
at::Tensor PadColumns(const at::Tensor& t, int64_t to) {
  const int64_t n = t.size(-1);
  if (n == to) return t;
  std::vector<int64_t> shape = t.sizes().vec();
  shape.back() = to - n;
  return at::cat({t, at::zeros(shape, t.options())}, -1);
}

}  // namespace

at::Tensor DequantizeInt4(const Int4Weight& w, int64_t group_size, int64_t cols) {
  TORCH_CHECK(w.bytes.scalar_type() == at::kByte && w.bytes.size(-1) == Int4RowBytes(cols),
              "int4 weight: want uint8 bytes [..., rows, ", Int4RowBytes(cols), "] for ", cols,
              " columns, got ", w.bytes.scalar_type(), " ", w.bytes.sizes());
  TORCH_CHECK(group_size > 0 && w.scale.scalar_type() == at::kBFloat16 &&
                  w.scale.size(-1) == (cols + group_size - 1) / group_size,
              "int4 weight: want bfloat16 scales [..., rows, ",
              (cols + group_size - 1) / group_size, "], got ", w.scale.scalar_type(), " ",
              w.scale.sizes());
  const at::Tensor b = w.bytes.to(at::kInt);
  std::vector<int64_t> shape = w.bytes.sizes().vec();
  shape.back() = -1;
  at::Tensor q = at::stack({b.bitwise_and(15), b.bitwise_right_shift(4)}, -1)
                     .reshape(shape)
                     .narrow(-1, 0, cols)
                     .sub(8);
  auto per_column = [&](const at::Tensor& t) {
    return t.repeat_interleave(group_size, -1).narrow(-1, 0, cols);
  };
  if (w.zero_point.defined()) q = q - per_column(w.zero_point.to(at::kInt));
  return q.to(at::kBFloat16) * per_column(w.scale);
}

Int4Weight QuantizeInt4(const at::Tensor& weight, int64_t group_size, bool symmetric) {
  TORCH_CHECK(weight.dim() >= 2 && at::isFloatingType(weight.scalar_type()),
              "QuantizeInt4 takes a floating [..., rows, cols] weight, got ", weight.sizes());
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0, "int4 group size must be even, got ",
              group_size);
  const int64_t cols = weight.size(-1);
  const int64_t groups = (cols + group_size - 1) / group_size;
  std::vector<int64_t> grouped = weight.sizes().vec();
  grouped.back() = groups;
  grouped.push_back(group_size);
  const at::Tensor w = PadColumns(weight.to(at::kFloat), groups * group_size).reshape(grouped);
  Int4Weight out;
  at::Tensor scale, zero;
  if (symmetric) {
    scale = w.abs().amax(-1).div(7.5);
  } else {
    const at::Tensor lo = w.amin(-1).clamp_max(0), hi = w.amax(-1).clamp_min(0);
    scale = (hi - lo).div(15.0);
  }
  scale = at::where(scale.eq(0), at::ones_like(scale), scale).to(at::kBFloat16);
  const at::Tensor s = scale.to(at::kFloat).unsqueeze(-1);
  at::Tensor q;
  if (symmetric) {
    q = (w / s).round().clamp(-8, 7);
  } else {
    zero = (-8.0 - w.amin(-1).clamp_max(0) / s.squeeze(-1)).round().clamp(-8, 7);
    q = (w / s + zero.unsqueeze(-1)).round().clamp(-8, 7);
    out.zero_point = zero.to(at::kChar).contiguous();
  }
  out.scale = scale.contiguous();
  // Back to [..., rows, cols], padded with zero nibbles to whole 32-bit
  // words per row (as compressed-tensors pads), then two per byte, the low
  // nibble first.
  std::vector<int64_t> flat = weight.sizes().vec();
  const int64_t padded = 2 * Int4RowBytes(cols);
  at::Tensor u = q.reshape({-1, groups * group_size}).narrow(1, 0, cols).add(8).to(at::kByte);
  u = PadColumns(u, padded);
  const at::Tensor lo = u.slice(1, 0, padded, 2), hi = u.slice(1, 1, padded, 2);
  flat.back() = padded / 2;
  out.bytes = lo.bitwise_or(hi.bitwise_left_shift(4)).reshape(flat).contiguous();
  return out;
}

}  // namespace moefit::experts
