// Fuzz target for the safetensors parser and the index parser.
//
// Safetensors files come from the Hub, from other people's training runs, from
// half-finished downloads: the parser is the one piece of moefit that reads
// bytes nobody vouched for. This target feeds arbitrary bytes to the same code
// SafetensorsFile::Open runs on a mapping (FromBuffer), then checks what a
// successful parse promises: every tensor span lies inside the input and has
// numel x dtype-size bytes, names are unique, natural order sorts. A failed
// parse must say which input it was. Anything else (out-of-bounds read, UB,
// abort) is found by the sanitizers it is built with.
//
// Built two ways (tests/checkpoint/CMakeLists.txt): with clang's libFuzzer when
// available, and always as a plain driver (safetensors_fuzz_driver.cc) that
// replays seeds and deterministic mutations under ctest.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/natural_order.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/safetensors_index.h"

namespace {

using moefit::checkpoint::SafetensorsFile;
using moefit::checkpoint::TensorInfo;

constexpr std::string_view kInputName = "fuzz-input";

// A broken promise: stop here so the fuzzer records the input.
#define FUZZ_CHECK(condition)           \
  do {                                  \
    if (!(condition)) __builtin_trap(); \
  } while (0)

void CheckParsedFile(const SafetensorsFile& file, const uint8_t* data, size_t size) {
  const auto* begin = reinterpret_cast<const std::byte*>(data);
  const std::byte* end = begin + size;
  uint8_t checksum = 0;
  for (const TensorInfo& info : file.tensors()) {
    const std::span<const std::byte> bytes = file.TensorBytes(info);
    FUZZ_CHECK(bytes.empty() || (bytes.data() >= begin && bytes.data() + bytes.size() <= end));
    FUZZ_CHECK(moefit::checkpoint::DtypeByteSize(info.dtype, static_cast<uint64_t>(info.numel)) ==
               bytes.size());
    FUZZ_CHECK(file.Find(info.name) == &info);
    // Read every byte the header claims, so ASan sees any span past the input.
    for (std::byte b : bytes) checksum ^= static_cast<uint8_t>(b);
  }
  const std::vector<std::string> sorted = file.SortedTensorNames();
  FUZZ_CHECK(
      std::is_sorted(sorted.begin(), sorted.end(), moefit::checkpoint::NaturalLessCompare{}));
  volatile uint8_t sink = checksum;
  (void)sink;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  absl::StatusOr<SafetensorsFile> file =
      SafetensorsFile::FromBuffer(bytes, std::string(kInputName), /*owner=*/nullptr);
  if (file.ok()) {
    CheckParsedFile(*file, data, size);
  } else {
    const absl::string_view message = file.status().message();
    FUZZ_CHECK(message.find(absl::string_view(kInputName.data(), kInputName.size())) !=
               absl::string_view::npos);
  }

  // The same bytes as an index file.
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<moefit::checkpoint::ShardedIndex> index =
      moefit::checkpoint::ParseShardedIndex(text, "fuzz-index");
  if (index.ok()) {
    for (const auto& [tensor, shard] : index->weight_map) {
      FUZZ_CHECK(!shard.empty() && shard.find('/') == std::string::npos);
    }
  }
  return 0;
}
