// Training checkpoint directories, manifests and checksums; see
// training_manifest.h.
#include "checkpoint/training_manifest.h"

#include <fcntl.h>
#include <tbb/parallel_for.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/internal/file_io.h"

namespace moefit::checkpoint {
namespace {

namespace fs = std::filesystem;

// Bytes per parallel CRC task: large enough that joining is free.
constexpr size_t kCrcChunk = size_t{8} << 20;

// A whole-file reader that keeps no more than one buffer in memory.
absl::StatusOr<uint32_t> FileCrc(const fs::path& path, uint64_t limit) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint file ", path.string(), " is missing: ", std::strerror(errno)));
  }
  std::vector<std::byte> buffer(std::min<uint64_t>(limit, 64u << 20));
  uint32_t crc = 0;
  uint64_t done = 0;
  while (done < limit) {
    const ssize_t n = ::read(fd, buffer.data(), std::min<uint64_t>(buffer.size(), limit - done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    crc = Crc32({buffer.data(), static_cast<size_t>(n)}, crc);
    done += static_cast<uint64_t>(n);
  }
  ::close(fd);
  if (done != limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint file ", path.string(), " is shorter than its manifest says"));
  }
  return crc;
}

}  // namespace

std::string StepDirName(int64_t step) { return absl::StrFormat("step-%08d", step); }

uint32_t Crc32(std::span<const std::byte> bytes, uint32_t crc) {
  const auto* data = reinterpret_cast<const Bytef*>(bytes.data());
  if (bytes.size() < 2 * kCrcChunk) {
    return static_cast<uint32_t>(crc32_z(crc, data, bytes.size()));
  }
  const size_t num_chunks = (bytes.size() + kCrcChunk - 1) / kCrcChunk;
  std::vector<uint32_t> chunk_crcs(num_chunks);
  tbb::parallel_for(size_t{0}, num_chunks, [&](size_t i) {
    const size_t begin = i * kCrcChunk;
    const size_t len = std::min(kCrcChunk, bytes.size() - begin);
    chunk_crcs[i] = static_cast<uint32_t>(crc32_z(0, data + begin, len));
  });
  for (size_t i = 0; i < num_chunks; ++i) {
    const size_t len = std::min(kCrcChunk, bytes.size() - i * kCrcChunk);
    crc = Crc32Combine(crc, chunk_crcs[i], len);
  }
  return crc;
}

uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  return static_cast<uint32_t>(crc32_combine64(crc_a, crc_b, static_cast<z_off64_t>(length_b)));
}

absl::Status CompleteFileEntry(const fs::path& dir, uint64_t data_bytes, uint32_t data_crc,
                               proto::CheckpointFile* file) {
  const fs::path path = dir / file->path();
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  if (ec || size < data_bytes) {
    return absl::InternalError(absl::StrCat("cannot stat ", path.string()));
  }
  const uint64_t header_bytes = size - data_bytes;
  absl::StatusOr<uint32_t> header_crc = FileCrc(path, header_bytes);
  if (!header_crc.ok()) return header_crc.status();
  file->set_size_bytes(size);
  file->set_header_bytes(header_bytes);
  file->set_header_crc32(*header_crc);
  file->set_crc32(Crc32Combine(*header_crc, data_crc, data_bytes));
  return absl::OkStatus();
}

absl::Status WriteManifest(const fs::path& dir, const proto::TrainingCheckpointManifest& manifest) {
  std::string bytes;
  if (!manifest.SerializeToString(&bytes)) {
    return absl::InternalError(absl::StrCat("cannot serialize the manifest of ", dir.string()));
  }
  const std::span<const std::byte> part(reinterpret_cast<const std::byte*>(bytes.data()),
                                        bytes.size());
  return internal::WriteFileAtomically(dir / kManifestName, {&part, 1}, /*sync=*/true);
}

absl::StatusOr<proto::TrainingCheckpointManifest> ReadManifest(const fs::path& dir) {
  const fs::path path = dir / kManifestName;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path.string(), " is missing: ", dir.string(),
                                            " is not a complete training checkpoint"));
  }
  absl::StatusOr<std::string> bytes = internal::ReadFileToString(path);
  if (!bytes.ok()) return bytes.status();
  proto::TrainingCheckpointManifest manifest;
  if (!manifest.ParseFromString(*bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), " is not a valid training checkpoint manifest"));
  }
  if (!manifest.end_of_manifest()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), " is truncated (", bytes->size(),
                                                   " bytes, no end-of-manifest mark)"));
  }
  if (manifest.format_version() != kTrainingCheckpointFormatVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        path.string(), ": format_version ", manifest.format_version(),
        " is not the version this moefit reads (", kTrainingCheckpointFormatVersion, ")"));
  }
  return manifest;
}

std::vector<std::pair<int64_t, fs::path>> ListCheckpoints(const fs::path& save_dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(save_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory(ec) || !name.starts_with("step-")) continue;
    int64_t step = -1;
    const char* first = name.data() + 5;
    const char* last = name.data() + name.size();
    auto [ptr, err] = std::from_chars(first, last, step);
    if (err != std::errc() || ptr != last || step < 0) continue;
    if (!ReadManifest(e.path()).ok()) continue;
    out.emplace_back(step, e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

absl::StatusOr<fs::path> LatestCheckpoint(const fs::path& save_dir) {
  std::vector<std::pair<int64_t, fs::path>> all = ListCheckpoints(save_dir);
  if (all.empty()) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint.resume_from = 'latest': no complete "
                     "training checkpoint in '",
                     save_dir.string(), "'"));
  }
  return all.back().second;
}

absl::Status CheckFileHeader(const fs::path& dir, const proto::CheckpointFile& file) {
  const fs::path path = dir / file.path();
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint file ", path.string(), " (listed in the manifest) is missing"));
  }
  if (size != file.size_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint file ", path.string(), " has ", size,
                                                   " bytes, the manifest says ",
                                                   file.size_bytes()));
  }
  absl::StatusOr<uint32_t> crc = FileCrc(path, file.header_bytes());
  if (!crc.ok()) return crc.status();
  if (*crc != file.header_crc32()) {
    return absl::InvalidArgumentError(
        absl::StrCat("checksum mismatch in checkpoint file ", path.string(), " (header)"));
  }
  return absl::OkStatus();
}

absl::Status CheckWholeFile(const fs::path& dir, const proto::CheckpointFile& file) {
  const fs::path path = dir / file.path();
  absl::StatusOr<uint32_t> crc = FileCrc(path, file.size_bytes());
  if (!crc.ok()) return crc.status();
  if (*crc != file.crc32()) {
    return absl::InvalidArgumentError(
        absl::StrCat("checksum mismatch in checkpoint file ", path.string()));
  }
  return absl::OkStatus();
}

}  // namespace moefit::checkpoint
