// Command-line bridge between moefit's checkpoint code and the Python
// `safetensors` / `transformers` packages, for the pytests in tests/interop/.
//
//   safetensors_tool dump FILE    prints the file as JSON: metadata, and for each
//                                 tensor in file order its name, dtype, shape,
//                                 FNV-1a 64 of its raw bytes, and its values
//   safetensors_tool write FILE   writes a fixed set of tensors (see WriteFixed;
//                                 the pytest rebuilds the same tensors in Python)
//   safetensors_tool load DIR FAMILY OUT [--dtype float32|bfloat16]
//       [--first-expert N --num-experts M] [--fp8-block B0,B1] [--skip-layers-from N]
//       [--fp8-scale-suffix SUFFIX] [--int4 GROUP_SIZE,symmetric|asymmetric]
//                                 LoadCheckpoint of DIR with FAMILY's table; writes
//                                 the runtime tensors to the file OUT and prints
//                                 the LoadReport as JSON (test_fp8.py,
//                                 test_compressed_tensors.py). With --dtype
//                                 every floating target is asked for in that
//                                 dtype (a first, dtype-less load gives the
//                                 shapes); --int4 reads compressed-tensors
//                                 pack-quantized weights (LoadOptions::int4).
//   safetensors_tool export SRC FAMILY DST
//                                 LoadCheckpoint, then SaveCheckpoint to the
//                                 directory DST (test_export_families.py)
//
// Values are printed as numbers after conversion through tensor_io (to double,
// or raw for 64-bit integers, so nothing is rounded); non-finite floats as the
// strings "nan", "inf", "-inf". Dtypes torch cannot hold (F6_*) and packed F4
// get "values": null and are compared by checksum only. Exit status 1 with the
// error on stderr when the file cannot be read or written.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_io.h"
#include "checkpoint/weight_exporter.h"
#include "checkpoint/weight_loader.h"
#include "nlohmann/json.hpp"

namespace moefit::checkpoint {
namespace {

using Json = nlohmann::ordered_json;

uint64_t Fnv1a64(std::span<const std::byte> bytes) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (std::byte b : bytes) {
    hash ^= static_cast<uint8_t>(b);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

Json FloatValue(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  return value;
}

// Little-endian elements of type T straight from the bytes (no rounding).
template <typename T>
Json RawValues(std::span<const std::byte> bytes) {
  Json values = Json::array();
  for (size_t offset = 0; offset + sizeof(T) <= bytes.size(); offset += sizeof(T)) {
    T value;
    std::memcpy(&value, bytes.data() + offset, sizeof(T));
    values.push_back(value);
  }
  return values;
}

absl::StatusOr<Json> Values(const SafetensorsFile& file, const TensorInfo& info) {
  const std::span<const std::byte> bytes = file.TensorBytes(info);
  switch (info.dtype) {
    case Dtype::kI64:
      return RawValues<int64_t>(bytes);
    case Dtype::kU64:
      return RawValues<uint64_t>(bytes);
    case Dtype::kC64: {
      Json values = Json::array();
      for (size_t offset = 0; offset + 8 <= bytes.size(); offset += 8) {
        float parts[2];
        std::memcpy(parts, bytes.data() + offset, 8);
        values.push_back(Json::array({FloatValue(parts[0]), FloatValue(parts[1])}));
      }
      return values;
    }
    case Dtype::kF4:
    case Dtype::kF6E2M3:
    case Dtype::kF6E3M2:
      return Json(nullptr);
    default:
      break;
  }
  absl::StatusOr<at::Tensor> tensor = ReadTensor(file, info, {.dtype = at::kDouble});
  if (!tensor.ok()) return tensor.status();
  const at::Tensor flat = tensor->contiguous().view(-1);
  Json values = Json::array();
  const double* data = flat.const_data_ptr<double>();
  for (int64_t idx = 0; idx < flat.numel(); ++idx) values.push_back(FloatValue(data[idx]));
  return values;
}

int Dump(const std::string& path) {
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  if (!file.ok()) {
    std::cerr << file.status() << "\n";
    return 1;
  }
  Json out = Json::object();
  out["metadata"] = file->metadata();
  Json tensors = Json::array();
  for (const TensorInfo& info : file->tensors()) {
    absl::StatusOr<Json> values = Values(*file, info);
    if (!values.ok()) {
      std::cerr << values.status() << "\n";
      return 1;
    }
    char hash[17];
    std::snprintf(hash, sizeof(hash), "%016llx",
                  static_cast<unsigned long long>(Fnv1a64(file->TensorBytes(info))));
    tensors.push_back(Json{{"name", info.name},
                           {"dtype", std::string(DtypeName(info.dtype))},
                           {"shape", info.shape},
                           {"fnv1a64", hash},
                           {"values", *std::move(values)}});
  }
  out["tensors"] = std::move(tensors);
  std::cout << out.dump(1) << "\n";
  return 0;
}

// The fixed tensors of `write`; test_safetensors.py::expected_written_tensors
// builds the same ones with the same torch ops.
std::vector<std::pair<std::string, at::Tensor>> FixedTensors() {
  const at::Tensor ramp = at::arange(12, at::kDouble) * 0.37 - 1.1;
  const at::Tensor ints = at::arange(6, at::kLong);
  return {
      {"f32", ramp.to(at::kFloat).reshape({3, 4})},
      {"f64", ramp},
      {"f16", ramp.to(at::kHalf).reshape({2, 6})},
      {"bf16", ramp.to(at::kBFloat16)},
      {"f8_e4m3", ramp.to(at::kFloat8_e4m3fn)},
      {"f8_e5m2", ramp.to(at::kFloat8_e5m2)},
      {"i64", ints * 1000000000000LL - 2500000000000LL},
      {"i32", (ints * 100000 - 250000).to(at::kInt)},
      {"i16", (ints * 1000 - 2500).to(at::kShort)},
      {"i8", (ints * 40 - 100).to(at::kChar)},
      {"u8", (ints * 50).to(at::kByte)},
      {"u16", (ints * 10000).to(at::kUInt16)},
      {"u32", (ints * 800000000).to(at::kUInt32)},
      {"bool", at::arange(5, at::kLong).remainder(2).eq(0)},
      {"c64", at::complex(at::arange(4, at::kFloat), -at::arange(4, at::kFloat))},
      {"scalar", at::scalar_tensor(3.25, at::kFloat)},
      {"empty", at::zeros({0, 4}, at::kFloat)},
      {"model.layers.0.mlp.experts.10.w", at::arange(4, at::kFloat).reshape({2, 2})},
      {"model.layers.0.mlp.experts.9.w", -at::arange(4, at::kFloat).reshape({2, 2})},
  };
}

int Write(const std::string& path) {
  const absl::Status status = SaveTensors(
      path, FixedTensors(), {.metadata = {{"producer", "moefit safetensors_tool"}, {"step", "7"}}});
  if (!status.ok()) {
    std::cerr << status << "\n";
    return 1;
  }
  return 0;
}

Json ReportJson(const LoadReport& report) {
  return Json{{"missing", report.missing},
              {"unexpected", report.unexpected},
              {"mismatched", report.mismatched},
              {"ignored", report.ignored},
              {"skipped", report.skipped},
              {"num_files_opened", report.num_files_opened},
              {"num_tensors_read", report.num_tensors_read},
              {"num_bytes_read", report.num_bytes_read}};
}

// `load DIR FAMILY OUT [flags]`; returns the exit status.
int Load(const std::vector<std::string>& args) {
  if (args.size() % 2 == 0) {
    std::cerr << "load: flag without a value\n";
    return 2;
  }
  LoadOptions options;
  std::optional<at::ScalarType> dtype;
  for (size_t i = 3; i + 1 < args.size(); i += 2) {
    const std::string& flag = args[i];
    const std::string& value = args[i + 1];
    if (flag == "--dtype" && (value == "float32" || value == "bfloat16")) {
      dtype = value == "float32" ? at::kFloat : at::kBFloat16;
    } else if (flag == "--first-expert") {
      options.first_expert = std::stoll(value);
    } else if (flag == "--num-experts") {
      options.num_experts = std::stoll(value);
    } else if (flag == "--skip-layers-from") {
      options.skip_layers_from = std::stoll(value);
    } else if (flag == "--fp8-block" && value.find(',') != std::string::npos) {
      options.fp8_block = {std::stoll(value.substr(0, value.find(','))),
                           std::stoll(value.substr(value.find(',') + 1))};
    } else if (flag == "--fp8-scale-suffix") {
      options.fp8_scale_suffix = value;
    } else if (flag == "--int4" &&
               (value.ends_with(",symmetric") || value.ends_with(",asymmetric"))) {
      options.int4 = PackedInt4Format{.group_size = std::stoll(value.substr(0, value.find(','))),
                                      .symmetric = value.ends_with(",symmetric")};
    } else {
      std::cerr << "load: bad flag " << flag << " " << value << "\n";
      return 2;
    }
  }
  if (dtype) {
    LoadOptions shapes_only = options;
    absl::StatusOr<std::map<std::string, at::Tensor>> first =
        LoadCheckpoint(args[0], args[1], shapes_only);
    if (!first.ok()) {
      std::cerr << first.status() << "\n";
      return 1;
    }
    for (const auto& [name, t] : *first) {
      options.expected[name] = {std::vector<int64_t>(t.sizes().begin(), t.sizes().end()),
                                at::isFloatingType(t.scalar_type()) ? *dtype : t.scalar_type()};
    }
  }
  LoadReport report;
  absl::StatusOr<std::map<std::string, at::Tensor>> tensors =
      LoadCheckpoint(args[0], args[1], options, &report);
  std::cout << ReportJson(report).dump(1) << "\n";
  if (!tensors.ok()) {
    std::cerr << tensors.status() << "\n";
    return 1;
  }
  const absl::Status saved = SaveTensors(
      args[2], std::vector<std::pair<std::string, at::Tensor>>(tensors->begin(), tensors->end()));
  if (!saved.ok()) {
    std::cerr << saved << "\n";
    return 1;
  }
  return 0;
}

// `export SRC FAMILY DST`.
int Export(const std::vector<std::string>& args) {
  absl::StatusOr<std::map<std::string, at::Tensor>> tensors = LoadCheckpoint(args[0], args[1]);
  if (!tensors.ok()) {
    std::cerr << tensors.status() << "\n";
    return 1;
  }
  const absl::Status saved = SaveCheckpoint(args[2], args[1], *tensors);
  if (!saved.ok()) {
    std::cerr << saved << "\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace moefit::checkpoint

int main(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  const std::vector<std::string> args(argv + std::min(argc, 2), argv + argc);
  if (command == "dump" && args.size() == 1) return moefit::checkpoint::Dump(args[0]);
  if (command == "write" && args.size() == 1) return moefit::checkpoint::Write(args[0]);
  if (command == "load" && args.size() >= 3) return moefit::checkpoint::Load(args);
  if (command == "export" && args.size() == 3) return moefit::checkpoint::Export(args);
  std::cerr << "usage: " << argv[0]
            << " dump FILE | write FILE | load DIR FAMILY OUT [flags] | export SRC FAMILY DST\n";
  return 2;
}
