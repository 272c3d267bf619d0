// Byte-image builders for the safetensors tests (see safetensors_test_util.h).
#include "tests/checkpoint/safetensors_test_util.h"

#include <fstream>
#include <random>
#include <stdexcept>

namespace moefit::checkpoint::testing {

std::string SafetensorsBytesWithLength(uint64_t header_length, std::string_view header,
                                       std::string_view data) {
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((header_length >> (8 * i)) & 0xff));
  bytes.append(header);
  bytes.append(data);
  return bytes;
}

std::string SafetensorsBytes(std::string_view header, std::string_view data, bool pad) {
  std::string padded(header);
  if (pad) padded.append((8 - padded.size() % 8) % 8, ' ');
  return SafetensorsBytesWithLength(padded.size(), padded, data);
}

std::filesystem::path WriteBytes(const std::filesystem::path& dir, std::string_view name,
                                 std::string_view bytes) {
  const std::filesystem::path path = dir / std::string(name);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write test file " + path.string());
  return path;
}

std::string PseudoRandomBytes(size_t num_bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string bytes(num_bytes, '\0');
  for (char& c : bytes) c = static_cast<char>(rng() & 0xff);
  return bytes;
}

std::vector<std::string> FuzzSeeds() {
  std::vector<std::string> seeds;
  // Valid files.
  seeds.push_back(SafetensorsBytes("{}", ""));
  seeds.push_back(SafetensorsBytes(R"({"__metadata__":{"format":"pt"}})", ""));
  seeds.push_back(SafetensorsBytes(R"({"__metadata__":{"format":"pt","step":"7"},)"
                                   R"("a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
                                   R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]},)"
                                   R"("c":{"dtype":"BOOL","shape":[],"data_offsets":[22,23]},)"
                                   R"("d":{"dtype":"F4","shape":[2,2],"data_offsets":[23,25]},)"
                                   R"("e":{"dtype":"I64","shape":[0,5],"data_offsets":[25,25]}})",
                                   PseudoRandomBytes(25, 1)));
  seeds.push_back(SafetensorsBytes(
      R"({"model.layers.0.mlp.experts.10.w":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]},)"
      R"("model.layers.0.mlp.experts.9.w":{"dtype":"F6_E2M3","shape":[4],"data_offsets":[4,7]},)"
      R"("x":{"dtype":"C64","shape":[1],"data_offsets":[7,15]}})",
      PseudoRandomBytes(15, 2)));
  // Index files (the fuzz target also feeds its input to the index parser).
  seeds.push_back(
      R"({"metadata":{"total_size":16},"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}})");
  // Corrupt files, one per kind of check.
  seeds.push_back(std::string("\x05\x00\x00", 3));
  seeds.push_back(SafetensorsBytesWithLength(1000, "{}", ""));
  seeds.push_back(
      SafetensorsBytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)", "xxxx"));
  seeds.push_back(SafetensorsBytes(
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
      "xxxxxxxx"));
  seeds.push_back(SafetensorsBytes(
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})",
      "xxxxxx"));
  seeds.push_back(
      SafetensorsBytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", "xxxx"));
  seeds.push_back(
      SafetensorsBytes(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "xxxx"));
  seeds.push_back(SafetensorsBytes(
      R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", "xxxx"));
  seeds.push_back(
      SafetensorsBytes(R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}})", "xxxx"));
  seeds.push_back(
      SafetensorsBytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,99]}})", "xxxx"));
  return seeds;
}

}  // namespace moefit::checkpoint::testing
