// safetensors parsing, validation, mapping and writing (see safetensors.h).
//
// Reading is two steps with a hard line between them: ParseHeader checks every
// number in the header against the size of the buffer it came from, and only
// then does SafetensorsFile hand out spans, computed from already validated
// offsets. Writing builds the whole header first (so offsets are known), then
// streams the tensors into a temporary file that is synced and renamed.
#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cassert>
#include <cerrno>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/internal/file_io.h"
#include "checkpoint/internal/json.h"
#include "checkpoint/internal/strings.h"
#include "checkpoint/natural_order.h"
#include "nlohmann/json.hpp"

namespace moefit::checkpoint {
namespace {

using internal::AsAbsl;

using Json = nlohmann::ordered_json;

struct DtypeDesc {
  Dtype dtype;
  std::string_view name;
  int bits;
};

// In enum order, so kDtypeDescs[static_cast<int>(d)].dtype == d.
constexpr std::array<DtypeDesc, 22> kDtypeDescs = {{
    {Dtype::kBool, "BOOL", 8},
    {Dtype::kU8, "U8", 8},
    {Dtype::kI8, "I8", 8},
    {Dtype::kU16, "U16", 16},
    {Dtype::kI16, "I16", 16},
    {Dtype::kU32, "U32", 32},
    {Dtype::kI32, "I32", 32},
    {Dtype::kU64, "U64", 64},
    {Dtype::kI64, "I64", 64},
    {Dtype::kF16, "F16", 16},
    {Dtype::kBF16, "BF16", 16},
    {Dtype::kF32, "F32", 32},
    {Dtype::kF64, "F64", 64},
    {Dtype::kC64, "C64", 64},
    {Dtype::kF8E4M3, "F8_E4M3", 8},
    {Dtype::kF8E5M2, "F8_E5M2", 8},
    {Dtype::kF8E4M3Fnuz, "F8_E4M3FNUZ", 8},
    {Dtype::kF8E5M2Fnuz, "F8_E5M2FNUZ", 8},
    {Dtype::kF8E8M0, "F8_E8M0", 8},
    {Dtype::kF6E2M3, "F6_E2M3", 6},
    {Dtype::kF6E3M2, "F6_E3M2", 6},
    {Dtype::kF4, "F4", 4},
}};

constexpr bool DescsInEnumOrder() {
  for (size_t i = 0; i < kDtypeDescs.size(); ++i) {
    if (static_cast<size_t>(kDtypeDescs[i].dtype) != i) return false;
  }
  return true;
}
static_assert(DescsInEnumOrder(), "kDtypeDescs must list the dtypes in enum order");

constexpr std::array<Dtype, kDtypeDescs.size()> MakeAllDtypes() {
  std::array<Dtype, kDtypeDescs.size()> all{};
  for (size_t i = 0; i < all.size(); ++i) all[i] = kDtypeDescs[i].dtype;
  return all;
}
constexpr std::array<Dtype, kDtypeDescs.size()> kAllDtypes = MakeAllDtypes();

constexpr uint64_t kMaxDim = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

// Product of the dimensions, or nullopt if it exceeds int64 (torch's limit).
std::optional<uint64_t> CheckedNumel(std::span<const int64_t> shape) {
  uint64_t numel = 1;
  for (int64_t dim : shape) {
    if (dim < 0) return std::nullopt;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel) || numel > kMaxDim) {
      return std::nullopt;
    }
  }
  return numel;
}

std::string ShapeString(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Prefix of every message about one tensor.
std::string TensorContext(absl::string_view file, absl::string_view tensor) {
  return absl::StrCat(file, ": tensor \"", tensor, "\"");
}

uint64_t LoadLittleEndian64(std::span<const std::byte> bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<uint8_t>(bytes[i]);
  return value;
}

absl::StatusOr<std::map<std::string, std::string>> ParseMetadata(const Json& value,
                                                                 absl::string_view file) {
  std::map<std::string, std::string> metadata;
  if (value.is_null()) return metadata;
  if (!value.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": \"__metadata__\" is not a JSON object of strings"));
  }
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": \"__metadata__\" value of \"", key, "\" is not a string"));
    }
    metadata.emplace(key, item.get<std::string>());
  }
  return metadata;
}

// Validates one header entry against a data section of `data_size` bytes.
absl::StatusOr<TensorInfo> ParseTensorEntry(const std::string& tensor_name, const Json& entry,
                                            absl::string_view file, uint64_t data_size) {
  const std::string context = TensorContext(file, tensor_name);
  auto error = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": ", parts...));
  };
  if (!entry.is_object()) return error("header entry is not a JSON object");

  TensorInfo info;
  info.name = tensor_name;

  const auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end() || !dtype_it->is_string()) return error("missing string \"dtype\"");
  const std::string& dtype_name = dtype_it->get_ref<const std::string&>();
  const std::optional<Dtype> dtype = DtypeFromName(dtype_name);
  if (!dtype) return error("unknown dtype \"", dtype_name, "\"");
  info.dtype = *dtype;

  const auto shape_it = entry.find("shape");
  if (shape_it == entry.end() || !shape_it->is_array()) return error("missing array \"shape\"");
  info.shape.reserve(shape_it->size());
  for (size_t dim_idx = 0; dim_idx < shape_it->size(); ++dim_idx) {
    const Json& dim = (*shape_it)[dim_idx];
    // nlohmann stores non-negative integer literals as unsigned; negative ones
    // as signed; anything with a fraction or exponent as float.
    if (!dim.is_number_unsigned()) {
      return error("shape[", dim_idx, "] = ", dim.dump(), " is not a non-negative integer");
    }
    const uint64_t value = dim.get<uint64_t>();
    if (value > kMaxDim) return error("shape[", dim_idx, "] = ", value, " is too large");
    info.shape.push_back(static_cast<int64_t>(value));
  }
  const std::optional<uint64_t> numel = CheckedNumel(info.shape);
  if (!numel) return error("shape ", ShapeString(info.shape), " has more than 2^63-1 elements");
  info.numel = static_cast<int64_t>(*numel);

  const auto offsets_it = entry.find("data_offsets");
  if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
      !(*offsets_it)[0].is_number_unsigned() || !(*offsets_it)[1].is_number_unsigned()) {
    return error("\"data_offsets\" must be [begin, end], two non-negative integers, got ",
                 offsets_it == entry.end() ? std::string("nothing") : offsets_it->dump());
  }
  info.begin = (*offsets_it)[0].get<uint64_t>();
  info.end = (*offsets_it)[1].get<uint64_t>();
  if (info.end < info.begin) {
    return error("data_offsets [", info.begin, ", ", info.end, "] end before they begin");
  }
  if (info.end > data_size) {
    return error("data_offsets [", info.begin, ", ", info.end, "] run past the data section (",
                 data_size, " bytes)");
  }

  const std::optional<uint64_t> expected = DtypeByteSize(info.dtype, *numel);
  if (!expected) {
    uint64_t num_bits = 0;
    if (__builtin_mul_overflow(*numel, static_cast<uint64_t>(DtypeBits(info.dtype)), &num_bits)) {
      return error("shape ", ShapeString(info.shape), " of ", dtype_name,
                   " is too large: its size in bits overflows 64 bits");
    }
    return error(*numel, " elements of ", dtype_name, " (", DtypeBits(info.dtype),
                 " bits each) do not fill a whole number of bytes");
  }
  if (*expected != info.num_bytes()) {
    return error("data_offsets [", info.begin, ", ", info.end, "] hold ", info.num_bytes(),
                 " bytes, but shape ", ShapeString(info.shape), " of ", dtype_name, " needs ",
                 *expected);
  }
  return info;
}

// The byte ranges must tile [0, data_size) exactly: no overlap, no hole, no tail.
absl::Status CheckCoverage(const std::vector<TensorInfo>& tensors, uint64_t data_size,
                           absl::string_view file) {
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::pair(tensors[a].begin, tensors[a].end) <
           std::pair(tensors[b].begin, tensors[b].end);
  });
  uint64_t covered = 0;
  const TensorInfo* previous = nullptr;
  for (size_t tensor_idx : order) {
    const TensorInfo& info = tensors[tensor_idx];
    if (info.begin < covered) {
      return absl::InvalidArgumentError(
          absl::StrCat(TensorContext(file, info.name), ": bytes [", info.begin, ", ", info.end,
                       ") overlap tensor \"", previous->name, "\" bytes [", previous->begin, ", ",
                       previous->end, ")"));
    }
    if (info.begin > covered) {
      return absl::InvalidArgumentError(absl::StrCat(
          TensorContext(file, info.name), ": data section bytes [", covered, ", ", info.begin,
          ") before this tensor belong to no tensor (the data section must have no holes)"));
    }
    covered = info.end;
    previous = &info;
  }
  if (covered != data_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": data section has ", data_size, " bytes but the tensors cover only ", covered,
        previous ? absl::StrCat(" (the last one is \"", previous->name, "\")") : std::string()));
  }
  return absl::OkStatus();
}

// A read-only private mapping of a whole file, unmapped on destruction.
class MappedFile {
 public:
  static absl::StatusOr<std::shared_ptr<const MappedFile>> Map(const std::filesystem::path& path) {
    const std::string name = path.string();
    const int fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat(name, ": cannot open"));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      return absl::ErrnoToStatus(err, absl::StrCat(name, ": cannot stat"));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat(name, ": not a regular file"));
    }
    const size_t size = static_cast<size_t>(st.st_size);
    void* data = nullptr;
    if (size > 0) {  // mmap of zero bytes fails; an empty file is reported by ParseHeader
      data = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (data == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        return absl::ErrnoToStatus(err, absl::StrCat(name, ": cannot mmap ", size, " bytes"));
      }
    }
    ::close(fd);  // the mapping stays valid without the descriptor
    return std::shared_ptr<const MappedFile>(new MappedFile(data, size));
  }

  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(data_, size_);
  }

  std::span<const std::byte> bytes() const { return {static_cast<const std::byte*>(data_), size_}; }

 private:
  MappedFile(void* data, size_t size) : data_(data), size_(size) {}

  void* data_;
  size_t size_;
};

}  // namespace

// ---------------------------------------------------------------------------
// Dtype

std::span<const Dtype> AllDtypes() { return kAllDtypes; }

std::string_view DtypeName(Dtype dtype) { return kDtypeDescs[static_cast<size_t>(dtype)].name; }

std::optional<Dtype> DtypeFromName(std::string_view name) {
  for (const DtypeDesc& desc : kDtypeDescs) {
    if (desc.name == name) return desc.dtype;
  }
  return std::nullopt;
}

int DtypeBits(Dtype dtype) { return kDtypeDescs[static_cast<size_t>(dtype)].bits; }

std::optional<uint64_t> DtypeByteSize(Dtype dtype, uint64_t numel) {
  uint64_t bits = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(DtypeBits(dtype)), &bits)) {
    return std::nullopt;
  }
  if (bits % 8 != 0) return std::nullopt;
  return bits / 8;
}

// ---------------------------------------------------------------------------
// Parsing

absl::StatusOr<SafetensorsHeader> ParseHeader(std::span<const std::byte> file_bytes,
                                              std::string_view file_name) {
  const absl::string_view name = AsAbsl(file_name);
  if (file_bytes.size() < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": file has ", file_bytes.size(), " bytes, too short for the 8-byte header length"));
  }
  const uint64_t header_size = LoadLittleEndian64(file_bytes.first(8));
  if (header_size > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": header length ", header_size,
                                                   " exceeds the limit of ", kMaxHeaderBytes,
                                                   " bytes"));
  }
  const uint64_t available = file_bytes.size() - 8;
  if (header_size > available) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": header length ", header_size,
                                                   " runs past the end of the file (",
                                                   file_bytes.size(), " bytes)"));
  }
  const std::span<const std::byte> header_bytes = file_bytes.subspan(8, header_size);
  const std::string_view text(reinterpret_cast<const char*>(header_bytes.data()),
                              header_bytes.size());
  if (text.empty() || text.front() != '{') {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": header is not a JSON object (does not start with '{')"));
  }
  absl::StatusOr<Json> json =
      internal::ParseJsonRejectingDuplicates(text, absl::StrCat(name, ": header"));
  if (!json.ok()) return json.status();
  if (!json->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": header is not a JSON object"));
  }

  SafetensorsHeader header;
  header.data_offset = 8 + header_size;
  header.data_size = available - header_size;
  header.tensors.reserve(json->size());
  for (const auto& [key, value] : json->items()) {
    if (key == kMetadataKey) {
      absl::StatusOr<std::map<std::string, std::string>> metadata = ParseMetadata(value, name);
      if (!metadata.ok()) return metadata.status();
      header.metadata = *std::move(metadata);
      continue;
    }
    absl::StatusOr<TensorInfo> info = ParseTensorEntry(key, value, name, header.data_size);
    if (!info.ok()) return info.status();
    header.tensors.push_back(*std::move(info));
  }
  absl::Status coverage = CheckCoverage(header.tensors, header.data_size, name);
  if (!coverage.ok()) return coverage;
  return header;
}

// ---------------------------------------------------------------------------
// SafetensorsFile

struct SafetensorsFile::State {
  std::string name;
  SafetensorsHeader header;
  std::span<const std::byte> data;  // the data section
  std::shared_ptr<const void> owner;
  std::map<std::string, size_t, std::less<>> tensor_idx;  // name -> index in header.tensors
};

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::filesystem::path& path) {
  absl::StatusOr<std::shared_ptr<const MappedFile>> mapped = MappedFile::Map(path);
  if (!mapped.ok()) return mapped.status();
  const std::span<const std::byte> bytes = (*mapped)->bytes();
  return FromBuffer(bytes, path.string(), *std::move(mapped));
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::FromBuffer(std::span<const std::byte> file_bytes,
                                                            std::string name,
                                                            std::shared_ptr<const void> owner) {
  absl::StatusOr<SafetensorsHeader> header = ParseHeader(file_bytes, name);
  if (!header.ok()) return header.status();
  auto state = std::make_shared<State>();
  state->name = std::move(name);
  state->header = *std::move(header);
  state->data = file_bytes.subspan(state->header.data_offset, state->header.data_size);
  state->owner = std::move(owner);
  for (size_t idx = 0; idx < state->header.tensors.size(); ++idx) {
    state->tensor_idx.emplace(state->header.tensors[idx].name, idx);
  }
  return SafetensorsFile(std::move(state));
}

const std::string& SafetensorsFile::name() const { return state_->name; }

const std::vector<TensorInfo>& SafetensorsFile::tensors() const { return state_->header.tensors; }

std::vector<std::string> SafetensorsFile::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(tensors().size());
  for (const TensorInfo& info : tensors()) names.push_back(info.name);
  return names;
}

std::vector<std::string> SafetensorsFile::SortedTensorNames() const {
  std::vector<std::string> names = TensorNames();
  std::sort(names.begin(), names.end(), NaturalLessCompare{});
  return names;
}

const std::map<std::string, std::string>& SafetensorsFile::metadata() const {
  return state_->header.metadata;
}

const TensorInfo* SafetensorsFile::Find(std::string_view tensor_name) const {
  const auto it = state_->tensor_idx.find(tensor_name);
  return it == state_->tensor_idx.end() ? nullptr : &state_->header.tensors[it->second];
}

absl::StatusOr<const TensorInfo*> SafetensorsFile::Info(std::string_view tensor_name) const {
  const TensorInfo* info = Find(tensor_name);
  if (info == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(TensorContext(name(), AsAbsl(tensor_name)), ": no such tensor"));
  }
  return info;
}

absl::StatusOr<std::span<const std::byte>> SafetensorsFile::TensorBytes(
    std::string_view tensor_name) const {
  absl::StatusOr<const TensorInfo*> info = Info(tensor_name);
  if (!info.ok()) return info.status();
  return TensorBytes(**info);
}

std::span<const std::byte> SafetensorsFile::TensorBytes(const TensorInfo& info) const {
  // Offsets were validated against the data section by ParseHeader.
  assert(info.begin <= info.end && info.end <= state_->data.size());
  return state_->data.subspan(info.begin, info.num_bytes());
}

std::shared_ptr<const void> SafetensorsFile::keep_alive() const { return state_; }

uint64_t SafetensorsFile::data_size() const { return state_->header.data_size; }

// ---------------------------------------------------------------------------
// SafetensorsWriter

SafetensorsWriter::SafetensorsWriter(std::filesystem::path path, SafetensorsWriterOptions options)
    : path_(std::move(path)), options_(std::move(options)) {}

absl::Status SafetensorsWriter::Add(std::string name, Dtype dtype, std::vector<int64_t> shape,
                                    std::span<const std::byte> bytes,
                                    std::shared_ptr<const void> owner) {
  const std::string context = TensorContext(path_.string(), name);
  auto error = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": ", parts...));
  };
  if (finished_) {
    return absl::FailedPreconditionError(absl::StrCat(context, ": Add after Finish"));
  }
  if (name.empty()) return error("empty tensor name");
  if (name == kMetadataKey) return error("the name is reserved for the metadata map");
  if (entry_idx_.contains(name)) return error("added twice");
  for (int64_t dim : shape) {
    if (dim < 0) return error("negative dimension in shape ", ShapeString(shape));
  }
  const std::optional<uint64_t> numel = CheckedNumel(shape);
  if (!numel) return error("shape ", ShapeString(shape), " has more than 2^63-1 elements");
  const std::optional<uint64_t> expected = DtypeByteSize(dtype, *numel);
  if (!expected) {
    return error(*numel, " elements of ", AsAbsl(DtypeName(dtype)),
                 " do not fill a whole number of bytes");
  }
  if (*expected != bytes.size()) {
    return error(bytes.size(), " bytes given, but shape ", ShapeString(shape), " of ",
                 AsAbsl(DtypeName(dtype)), " needs ", *expected);
  }
  entry_idx_.emplace(name, entries_.size());
  data_size_ += bytes.size();
  entries_.push_back(Entry{std::move(name), dtype, std::move(shape), bytes, std::move(owner)});
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::AddCopy(std::string name, Dtype dtype, std::vector<int64_t> shape,
                                        std::span<const std::byte> bytes) {
  auto copy = std::make_shared<const std::vector<std::byte>>(bytes.begin(), bytes.end());
  const std::span<const std::byte> copied(copy->data(), copy->size());
  return Add(std::move(name), dtype, std::move(shape), copied, std::move(copy));
}

absl::Status SafetensorsWriter::Finish() {
  if (finished_) {
    return absl::FailedPreconditionError(absl::StrCat(path_.string(), ": Finish called twice"));
  }
  finished_ = true;
  // Release the queued tensors (and what keeps them alive) however this ends.
  const std::vector<Entry> entries = std::exchange(entries_, {});
  entry_idx_.clear();

  Json header = Json::object();
  Json metadata = Json::object();
  metadata["format"] = "pt";
  for (const auto& [key, value] : options_.metadata) metadata[key] = value;
  header[std::string(kMetadataKey)] = std::move(metadata);
  uint64_t offset = 0;
  for (const Entry& entry : entries) {
    Json info = Json::object();
    info["dtype"] = std::string(DtypeName(entry.dtype));
    info["shape"] = entry.shape;
    info["data_offsets"] = {offset, offset + entry.bytes.size()};
    header[entry.name] = std::move(info);
    offset += entry.bytes.size();
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    // The only failure dump() has: a tensor name or metadata string that is not UTF-8.
    return absl::InvalidArgumentError(
        absl::StrCat(path_.string(), ": header cannot be written: ", e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  if (text.size() > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path_.string(), ": header of ", text.size(),
                                                   " bytes exceeds the limit of ", kMaxHeaderBytes,
                                                   " (too many tensors for one file)"));
  }

  std::array<std::byte, 8> length{};
  uint64_t header_size = text.size();
  for (std::byte& byte : length) {
    byte = static_cast<std::byte>(header_size & 0xff);
    header_size >>= 8;
  }
  std::vector<std::span<const std::byte>> parts;
  parts.reserve(entries.size() + 2);
  parts.push_back(length);
  parts.push_back(std::as_bytes(std::span(text)));
  for (const Entry& entry : entries) parts.push_back(entry.bytes);
  return internal::WriteFileAtomically(path_, parts, options_.sync);
}

}  // namespace moefit::checkpoint
