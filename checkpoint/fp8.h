// Block-scaled FP8 weights (DeepSeek-V3 / Kimi-K2 checkpoints): widened to a
// training dtype, or kept as they are for frozen experts.
//
// DeepSeek-V3 and Kimi-K2 publish every Linear weight except the router, the
// embeddings and the LM head as
//   X.weight            F8_E4M3 [out, in]
//   X.weight_scale_inv  F32     [ceil(out / B0), ceil(in / B1)]
// where (B0, B1) is config.json's quantization_config.weight_block_size
// ([128, 128] for the published models). Element (r, c) is worth
//   fp8(r, c) * scale_inv[r / B0][c / B1]
// and sizes need not be multiples of the block: the last block of a row or
// column is partial. moefit trains in fp32 / bf16, so the loader widens these
// weights as it reads them -- except a frozen base's routed experts, which may
// stay FP8 (the loader then reads the bytes and the scales as they are, and the
// expert kernels convert block by block as they multiply).
//
// Both functions below compute the same thing: the product in fp32, rounded
// once to the destination dtype. DequantizeBlockFp8Into is the loader's: one
// pass over the FP8 bytes (a 256-entry table gives each byte's value), written
// straight into the destination, which may be a strided view such as one
// expert's rows of a packed gate_up_proj, so nothing larger than the scales is
// allocated. DequantizeBlockFp8Reference is the obviously correct torch version
// (upcast, expand the scales to the weight's shape, multiply, cast) that tests
// hold the loader to.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/safetensors.h"

namespace moefit::checkpoint {

// Block of the published DeepSeek-V3 / Kimi-K2 checkpoints: [rows, columns].
inline constexpr std::array<int64_t, 2> kDefaultFp8Block = {128, 128};

// `X.weight_scale_inv` scales `X.weight`.
inline constexpr std::string_view kScaleInvSuffix = "_scale_inv";

// The 8-bit float dtypes whose tensors are stored block-scaled (F8_E4M3, F8_E5M2
// and their FNUZ variants; not F8_E8M0, which only ever holds scales).
bool IsFp8Dtype(Dtype dtype);
bool IsFp8Dtype(at::ScalarType type);

// Dtypes a scale may have: F32 (DeepSeek-V3), BF16, F16 or F8_E8M0 (powers of
// two); each converts to fp32 exactly.
bool IsScaleDtype(Dtype dtype);

// [ceil(rows / block[0]), ceil(cols / block[1])] for a [rows, cols] weight.
std::vector<int64_t> BlockScaleShape(at::IntArrayRef weight_shape, std::array<int64_t, 2> block);

// Writes the dequantized `weight` (2-D, an FP8 dtype) into `dst` (same shape, any
// floating dtype, any strides), scaled by `scale_inv` (BlockScaleShape of the
// weight, any dtype torch converts to fp32). Parallel over row blocks.
// InvalidArgument when a shape or dtype does not fit; callers add the tensor's name.
absl::Status DequantizeBlockFp8Into(at::Tensor dst, const at::Tensor& weight,
                                    const at::Tensor& scale_inv, std::array<int64_t, 2> block);

// The reference: (weight.to(fp32) * scale_inv expanded block-wise).to(dtype),
// written with plain torch ops. Same errors as DequantizeBlockFp8Into.
absl::StatusOr<at::Tensor> DequantizeBlockFp8Reference(const at::Tensor& weight,
                                                       const at::Tensor& scale_inv,
                                                       std::array<int64_t, 2> block,
                                                       at::ScalarType dtype);

// Quantizes `weight` (2-D, or 3-D as [E, rows, cols]: each [rows, cols]
// matrix on its own) to float8_e4m3fn with one float32 scale per block, as
// DeepSeek-V3's checkpoints were made: scale_inv = amax(|block|) / 448 (1 for
// an all-zero block) and fp8 = round(weight / scale_inv). Returns {fp8,
// scale_inv} with scale_inv [.., ceil(rows / block[0]), ceil(cols / block[1])].
// For weights drawn at random where no checkpoint gives them (tests,
// benchmarks, a model started from scratch with frozen FP8 experts).
absl::StatusOr<std::pair<at::Tensor, at::Tensor>> QuantizeBlockFp8(const at::Tensor& weight,
                                                                   std::array<int64_t, 2> block);

}  // namespace moefit::checkpoint
