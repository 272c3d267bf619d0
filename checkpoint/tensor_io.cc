// Tensor views and conversions over safetensors files (see tensor_io.h).
//
// Every torch call that can throw (c10::Error) sits inside one try block per
// public function, so callers only ever see absl::Status, with the file and
// tensor in the message.
#include "checkpoint/tensor_io.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "checkpoint/internal/strings.h"

namespace moefit::checkpoint {
namespace {

using ScalarType = at::ScalarType;
using internal::AsAbsl;

std::string Context(absl::string_view file, absl::string_view tensor) {
  return absl::StrCat(file, ": tensor \"", tensor, "\"");
}

// Torch sizes for a stored shape (F4: two values per torch element).
absl::StatusOr<std::vector<int64_t>> TorchSizes(const TensorInfo& info, absl::string_view file) {
  std::vector<int64_t> sizes = info.shape;
  if (info.dtype == Dtype::kF4) {
    if (sizes.empty() || sizes.back() % 2 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(Context(file, info.name),
                       ": F4 needs an even last dimension to be held as torch Float4_e2m1fn_x2"));
    }
    sizes.back() /= 2;
  }
  return sizes;
}

// A safetensors BOOL is one byte, 0 or 1; anything else is not a valid torch bool.
absl::Status CheckBoolBytes(std::span<const std::byte> bytes, const TensorInfo& info,
                            absl::string_view file) {
  const auto bad = std::find_if(bytes.begin(), bytes.end(),
                                [](std::byte b) { return static_cast<uint8_t>(b) > 1; });
  if (bad == bytes.end()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      Context(file, info.name), ": BOOL element ", bad - bytes.begin(), " has byte value ",
      static_cast<int>(static_cast<uint8_t>(*bad)), " (must be 0 or 1)"));
}

}  // namespace

std::optional<at::ScalarType> ToScalarType(Dtype dtype) {
  switch (dtype) {
    case Dtype::kBool:
      return ScalarType::Bool;
    case Dtype::kU8:
      return ScalarType::Byte;
    case Dtype::kI8:
      return ScalarType::Char;
    case Dtype::kU16:
      return ScalarType::UInt16;
    case Dtype::kI16:
      return ScalarType::Short;
    case Dtype::kU32:
      return ScalarType::UInt32;
    case Dtype::kI32:
      return ScalarType::Int;
    case Dtype::kU64:
      return ScalarType::UInt64;
    case Dtype::kI64:
      return ScalarType::Long;
    case Dtype::kF16:
      return ScalarType::Half;
    case Dtype::kBF16:
      return ScalarType::BFloat16;
    case Dtype::kF32:
      return ScalarType::Float;
    case Dtype::kF64:
      return ScalarType::Double;
    case Dtype::kC64:
      return ScalarType::ComplexFloat;
    case Dtype::kF8E4M3:
      return ScalarType::Float8_e4m3fn;
    case Dtype::kF8E5M2:
      return ScalarType::Float8_e5m2;
    case Dtype::kF8E4M3Fnuz:
      return ScalarType::Float8_e4m3fnuz;
    case Dtype::kF8E5M2Fnuz:
      return ScalarType::Float8_e5m2fnuz;
    case Dtype::kF8E8M0:
      return ScalarType::Float8_e8m0fnu;
    case Dtype::kF4:
      return ScalarType::Float4_e2m1fn_x2;
    case Dtype::kF6E2M3:
    case Dtype::kF6E3M2:
      return std::nullopt;
  }
  return std::nullopt;
}

absl::StatusOr<Dtype> ToDtype(at::ScalarType type) {
  for (Dtype dtype : AllDtypes()) {
    if (ToScalarType(dtype) == type) return dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("torch dtype ", c10::toString(type), " has no safetensors equivalent"));
}

absl::StatusOr<at::Tensor> ReadTensor(const SafetensorsFile& file, std::string_view tensor_name,
                                      const ReadTensorOptions& options) {
  absl::StatusOr<const TensorInfo*> info = file.Info(tensor_name);
  if (!info.ok()) return info.status();
  return ReadTensor(file, **info, options);
}

absl::StatusOr<at::Tensor> ReadTensor(const SafetensorsFile& file, const TensorInfo& info,
                                      const ReadTensorOptions& options) {
  const std::optional<at::ScalarType> stored = ToScalarType(info.dtype);
  if (!stored) {
    return absl::InvalidArgumentError(absl::StrCat(Context(file.name(), info.name), ": dtype ",
                                                   AsAbsl(DtypeName(info.dtype)),
                                                   " has no torch equivalent"));
  }
  absl::StatusOr<std::vector<int64_t>> sizes = TorchSizes(info, file.name());
  if (!sizes.ok()) return sizes.status();
  const std::span<const std::byte> bytes = file.TensorBytes(info);
  if (info.dtype == Dtype::kBool) {
    absl::Status valid = CheckBoolBytes(bytes, info, file.name());
    if (!valid.ok()) return valid;
  }
  const at::ScalarType target = options.dtype.value_or(*stored);

  try {
    const auto stored_options = at::TensorOptions().dtype(*stored).device(at::kCPU);
    const size_t element_size = c10::elementSize(*stored);
    const bool aligned = reinterpret_cast<uintptr_t>(bytes.data()) % element_size == 0;
    at::Tensor stored_tensor;
    bool is_view = false;
    if (bytes.empty() || !aligned) {
      // Own, aligned memory: torch kernels may assume element alignment.
      stored_tensor = at::empty(*sizes, stored_options);
      if (!bytes.empty()) std::memcpy(stored_tensor.data_ptr(), bytes.data(), bytes.size());
    } else {
      // from_blob wants a mutable pointer; the mapping is read-only (see header).
      void* data = const_cast<std::byte*>(bytes.data());
      stored_tensor = at::from_blob(
          data, *sizes, [keep_alive = file.keep_alive()](void*) {}, stored_options);
      is_view = true;
    }
    if (target != *stored) return stored_tensor.to(target);
    if (options.copy && is_view) return stored_tensor.clone();
    return stored_tensor;
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        Context(file.name(), info.name), ": cannot read ", AsAbsl(DtypeName(info.dtype)), " as ",
        c10::toString(target), ": ", e.what_without_backtrace()));
  }
}

absl::Status AddTensor(SafetensorsWriter& writer, std::string name, const at::Tensor& tensor) {
  const std::string context = Context(writer.path().string(), name);
  if (!tensor.defined()) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": undefined tensor"));
  }
  if (tensor.layout() != at::kStrided) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": only dense (strided) tensors can be stored"));
  }
  absl::StatusOr<Dtype> dtype = ToDtype(tensor.scalar_type());
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": ", dtype.status().message()));
  }
  std::shared_ptr<const at::Tensor> cpu;
  try {
    at::Tensor host = tensor.detach().to(at::kCPU).contiguous();
    // Lazy conjugate / negative views must be materialized before reading bytes.
    host = host.resolve_conj().resolve_neg();
    cpu = std::make_shared<const at::Tensor>(std::move(host));
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": cannot copy to the CPU: ", e.what_without_backtrace()));
  }
  std::vector<int64_t> shape(cpu->sizes().begin(), cpu->sizes().end());
  if (*dtype == Dtype::kF4) {
    if (shape.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, ": a 0-d Float4_e2m1fn_x2 tensor has no F4 shape"));
    }
    shape.back() *= 2;  // two F4 values per torch element
  }
  const std::span<const std::byte> bytes(static_cast<const std::byte*>(cpu->const_data_ptr()),
                                         cpu->nbytes());
  return writer.Add(std::move(name), *dtype, std::move(shape), bytes, std::move(cpu));
}

absl::Status SaveTensors(const std::filesystem::path& path,
                         const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                         SafetensorsWriterOptions options) {
  SafetensorsWriter writer(path, std::move(options));
  for (const auto& [name, tensor] : tensors) {
    absl::Status added = AddTensor(writer, name, tensor);
    if (!added.ok()) return added;
  }
  return writer.Finish();
}

}  // namespace moefit::checkpoint
