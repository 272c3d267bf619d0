// The safetensors file format, at the level of bytes: no torch here.
//
// Every checkpoint moefit reads or writes (HF model directories, training state,
// PEFT adapters) is safetensors: an 8-byte little-endian header length N, N bytes
// of JSON describing each tensor (dtype, shape, byte range in the data section,
// plus an optional "__metadata__" map of strings), then the data section. This
// layer maps a file read-only, validates the header completely before anyone
// touches a tensor, and hands out byte spans into the mapping; tensor_io.h turns
// those into at::Tensors. Keeping it torch-free lets the parser be fuzzed and
// built with sanitizers in seconds, and lets tools that only list or copy
// tensors (inspect, reshard) run without LibTorch.
//
// Validation follows the reference implementation (huggingface/safetensors) and
// is strict: a file is rejected if the header is too large or runs past the
// file, is not a JSON object, repeats a key, names an unknown dtype, has a shape
// that is not a list of non-negative integers (or whose element count
// overflows), has data_offsets that are not [begin, end] with begin <= end within
// the data section, has a byte size other than numel x dtype size, or leaves
// holes or overlaps in the data section (the byte ranges must tile it exactly).
// Every error names the file and, where there is one, the tensor. Nothing is
// read outside the mapping, whatever the header says.
//
// Files are assumed little-endian, as the format requires; so is the host. As
// with any mmap, a file truncated by another process while mapped faults
// (SIGBUS) when the lost pages are touched; checkpoints are written by rename,
// never truncated in place, so this only arises from outside interference.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts would need byte swapping");

namespace moefit::checkpoint {

// Element types of the safetensors format (all those the reference
// implementation accepts as of safetensors 0.8). Sub-byte types (F4, F6_*) are
// packed: a tensor of n elements takes n x bits / 8 bytes, which must be whole.
enum class Dtype : uint8_t {
  kBool,
  kU8,
  kI8,
  kU16,
  kI16,
  kU32,
  kI32,
  kU64,
  kI64,
  kF16,
  kBF16,
  kF32,
  kF64,
  kC64,         // complex: two F32
  kF8E4M3,      // "F8_E4M3"; torch float8_e4m3fn
  kF8E5M2,      // "F8_E5M2"
  kF8E4M3Fnuz,  // "F8_E4M3FNUZ"
  kF8E5M2Fnuz,  // "F8_E5M2FNUZ"
  kF8E8M0,      // "F8_E8M0"; torch float8_e8m0fnu (MX block scales)
  kF6E2M3,      // "F6_E2M3"
  kF6E3M2,      // "F6_E3M2"
  kF4,          // "F4"; FP4 E2M1, two per byte
};

// Every Dtype, in enum order.
std::span<const Dtype> AllDtypes();

// The header spelling ("BF16", "F8_E4M3", ...).
std::string_view DtypeName(Dtype dtype);

// Inverse of DtypeName; nullopt for a name the format does not define.
std::optional<Dtype> DtypeFromName(std::string_view name);

// Size of one element in bits (4, 6, 8, 16, 32 or 64).
int DtypeBits(Dtype dtype);

// Bytes taken by `numel` elements, or nullopt when they do not fill whole bytes
// (sub-byte types) or the size overflows 64 bits.
std::optional<uint64_t> DtypeByteSize(Dtype dtype, uint64_t numel);

// Largest header accepted (the reference implementation's limit).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Header key of the free-form string map.
inline constexpr std::string_view kMetadataKey = "__metadata__";

// One tensor as described by the header.
struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::kU8;
  std::vector<int64_t> shape;  // empty for a scalar
  int64_t numel = 0;
  // Byte range [begin, end) relative to the start of the data section.
  uint64_t begin = 0;
  uint64_t end = 0;

  uint64_t num_bytes() const { return end - begin; }
};

// A validated header.
struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;              // in header (file) order
  std::map<std::string, std::string> metadata;  // "__metadata__", empty if absent
  uint64_t data_offset = 0;                     // where the data section starts in the file (8 + N)
  uint64_t data_size = 0;                       // bytes in the data section
};

// Parses and validates a whole safetensors file held in memory. `name` is what
// error messages call the file (normally its path). This is the entry point the
// fuzzer drives; SafetensorsFile::Open calls it on the mapping.
absl::StatusOr<SafetensorsHeader> ParseHeader(std::span<const std::byte> file_bytes,
                                              std::string_view name);

// A validated safetensors file and the memory holding it (normally a read-only
// mmap). Copies are cheap and share that memory; it is released when the last
// copy, and the last holder of keep_alive(), goes away. Thread-safe for reads.
class SafetensorsFile {
 public:
  // Maps `path` read-only and validates it. Errors: NotFound / PermissionDenied /
  // ... for the file itself, InvalidArgument for a malformed file.
  static absl::StatusOr<SafetensorsFile> Open(const std::filesystem::path& path);

  // Validates a file image already in memory. `owner` keeps `file_bytes` valid
  // and is held as long as the result (or its keep_alive()) lives; pass nullptr
  // when the caller guarantees the bytes outlive every use.
  static absl::StatusOr<SafetensorsFile> FromBuffer(std::span<const std::byte> file_bytes,
                                                    std::string name,
                                                    std::shared_ptr<const void> owner);

  // The path (or buffer name) used in messages.
  const std::string& name() const;

  // All tensors in header (file) order.
  const std::vector<TensorInfo>& tensors() const;
  size_t num_tensors() const { return tensors().size(); }

  // Tensor names in header order, and in natural order (experts.9 before experts.10).
  std::vector<std::string> TensorNames() const;
  std::vector<std::string> SortedTensorNames() const;

  const std::map<std::string, std::string>& metadata() const;

  // The tensor called `tensor_name`, or nullptr.
  const TensorInfo* Find(std::string_view tensor_name) const;

  // As Find, but a NotFound error naming the file and the tensor when absent.
  absl::StatusOr<const TensorInfo*> Info(std::string_view tensor_name) const;

  // The tensor's bytes inside the mapping, valid while this object or a
  // keep_alive() handle lives. Read-only: the mapping is PROT_READ.
  absl::StatusOr<std::span<const std::byte>> TensorBytes(std::string_view tensor_name) const;
  // Same for an entry of tensors() of this very file.
  std::span<const std::byte> TensorBytes(const TensorInfo& info) const;

  // A handle that keeps the mapping alive, e.g. for the deleter of a tensor
  // view that outlives this object.
  std::shared_ptr<const void> keep_alive() const;

  // Bytes in the data section; the file is 8 + header + data_size bytes.
  uint64_t data_size() const;

 private:
  struct State;
  explicit SafetensorsFile(std::shared_ptr<const State> state) : state_(std::move(state)) {}

  std::shared_ptr<const State> state_;
};

struct SafetensorsWriterOptions {
  // Written to "__metadata__" after {"format": "pt"} (a "format" here replaces it).
  std::map<std::string, std::string> metadata;
  // fsync the file before the rename and the directory after it. Only tests
  // writing throwaway files should turn this off.
  bool sync = true;
};

// Writes one safetensors file. Tensors are laid out contiguously in the order
// they are added, after a header padded with spaces to a multiple of 8 bytes.
// Nothing touches the disk until Finish(), which writes `<path>.tmp`, syncs it
// and renames it over `path`: a crash leaves either the old file or the new
// one, never a truncated file under the real name.
//
// Tensors are not aligned to their element size beyond what the order gives
// (as in the reference writer's output when dtypes are mixed); readers that need
// alignment (tensor_io) copy misaligned tensors.
class SafetensorsWriter {
 public:
  explicit SafetensorsWriter(std::filesystem::path path, SafetensorsWriterOptions options = {});

  // Queues a tensor. `bytes` are not copied: they must stay valid until
  // Finish() returns, which `owner` (if not null) guarantees by being held until
  // then. Errors (InvalidArgument, naming file and tensor): empty or reserved
  // name, duplicate name, negative dimension, element-count overflow, or a byte
  // count other than numel x dtype size.
  absl::Status Add(std::string name, Dtype dtype, std::vector<int64_t> shape,
                   std::span<const std::byte> bytes, std::shared_ptr<const void> owner = nullptr);

  // As Add, but copies the bytes first.
  absl::Status AddCopy(std::string name, Dtype dtype, std::vector<int64_t> shape,
                       std::span<const std::byte> bytes);

  // Writes the file (see the class comment). May be called once; the queued
  // tensors and their owners are released afterwards, on success or failure.
  absl::Status Finish();

  const std::filesystem::path& path() const { return path_; }
  size_t num_tensors() const { return entries_.size(); }
  // Bytes of tensor data queued so far.
  uint64_t data_size() const { return data_size_; }

 private:
  struct Entry {
    std::string name;
    Dtype dtype;
    std::vector<int64_t> shape;
    std::span<const std::byte> bytes;
    std::shared_ptr<const void> owner;
  };

  std::filesystem::path path_;
  SafetensorsWriterOptions options_;
  std::vector<Entry> entries_;
  std::map<std::string, size_t, std::less<>> entry_idx_;
  uint64_t data_size_ = 0;
  bool finished_ = false;
};

}  // namespace moefit::checkpoint
