// at::Tensor on top of the safetensors byte layer.
//
// Reading a checkpoint should cost no copy when it can: a tensor read in its
// stored dtype is an at::Tensor viewing the read-only file mapping, and the
// tensor's deleter holds the mapping alive, so it can outlive the
// SafetensorsFile it came from. Asking for another dtype (BF16 weights read as
// F32 for the CPU experts, FP8 read as BF16) gives a converted copy, with
// exactly at::Tensor::to's rounding. Views must not be written to: the pages are
// PROT_READ and a write faults; ask for `copy` when the result will be modified.
//
// Writing takes tensors on any device, moves them to contiguous CPU memory and
// queues them in a SafetensorsWriter without a further copy.
//
// The header stays light (Tensor and ScalarType only); the heavy ATen headers
// come from the project's shared PCH in the .cc.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/safetensors.h"

namespace moefit::checkpoint {

// The torch dtype that holds `dtype`'s elements, or nullopt when torch has none
// (F6_E2M3, F6_E3M2). F4 maps to Float4_e2m1fn_x2, which packs two F4 values
// per torch element, so the last dimension of the torch tensor is half the
// stored one.
std::optional<at::ScalarType> ToScalarType(Dtype dtype);

// The safetensors dtype for a torch dtype; InvalidArgument for dtypes the
// format cannot store (quantized, complex double, bits, ...).
absl::StatusOr<Dtype> ToDtype(at::ScalarType type);

struct ReadTensorOptions {
  // Result dtype; nullopt keeps the stored one (and gives a view if possible).
  std::optional<at::ScalarType> dtype;
  // Always return an owned, writable tensor, never a view of the mapping.
  bool copy = false;
};

// Reads one tensor of `file`. Without conversion and copy the result views the
// mapping (unless the tensor's bytes are misaligned for its element type, when
// it is an aligned copy). Errors (naming file and tensor): NotFound for an
// unknown name; InvalidArgument for a dtype torch cannot hold, an F4 tensor with
// an odd last dimension, a BOOL byte other than 0 or 1, or a conversion torch
// refuses.
absl::StatusOr<at::Tensor> ReadTensor(const SafetensorsFile& file, std::string_view tensor_name,
                                      const ReadTensorOptions& options = {});
// Same for an entry of file.tensors().
absl::StatusOr<at::Tensor> ReadTensor(const SafetensorsFile& file, const TensorInfo& info,
                                      const ReadTensorOptions& options = {});

// Queues `tensor` (any device, any strides) in `writer` as a contiguous CPU
// copy, or the tensor itself when it already is one; the writer holds it until
// Finish(). Errors: undefined or non-strided tensors, dtypes without a
// safetensors equivalent, and whatever SafetensorsWriter::Add rejects.
absl::Status AddTensor(SafetensorsWriter& writer, std::string name, const at::Tensor& tensor);

// Writes `tensors` in the order given to `path` (see SafetensorsWriter).
absl::Status SaveTensors(const std::filesystem::path& path,
                         const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                         SafetensorsWriterOptions options = {});

}  // namespace moefit::checkpoint
