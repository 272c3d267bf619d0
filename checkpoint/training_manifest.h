// The on-disk side of training checkpoints, without the model: directory
// names, the manifest (proto/training_checkpoint.proto) and its checks, and
// the checksums.
//
// A training checkpoint is a directory save_dir/step-NNNNNNNN holding
// safetensors files and manifest.binpb. It is assembled under a hidden
// temporary name and renamed into place only when every file and the manifest
// are on disk, so a step-* directory with a readable manifest is complete;
// "latest" is the highest such step. The model side (what goes into the files,
// and how a rank reads back only its experts) is framework/training_checkpoint.h.
//
// Checksums are zlib's CRC-32 (Debian's zlib, already a dependency of
// protobuf), computed over large buffers in parallel chunks joined with
// crc32_combine, so that checking costs a fraction of reading.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/training_checkpoint.pb.h"

namespace moefit::checkpoint {

// Raised when the layout of the files or the meaning of a manifest field
// changes; a manifest of another version is refused.
inline constexpr uint32_t kTrainingCheckpointFormatVersion = 1;
inline constexpr char kManifestName[] = "manifest.binpb";

// "step-00000042".
std::string StepDirName(int64_t step);

// CRC-32 of `bytes` continuing from `crc` (0 to start), in parallel chunks.
uint32_t Crc32(std::span<const std::byte> bytes, uint32_t crc = 0);
// The CRC-32 of A followed by B, from the CRCs of A and B and B's length.
uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);

// Completes the entry of a safetensors file just written to dir/file->path()
// whose data section (`data_bytes` long) has CRC `data_crc`: its size, and
// the CRCs of its header and of the whole file (the header is read back; the
// data is not read again).
absl::Status CompleteFileEntry(const std::filesystem::path& dir, uint64_t data_bytes,
                               uint32_t data_crc, proto::CheckpointFile* file);

// Writes `manifest` to dir/manifest.binpb (through a fsynced temporary file).
absl::Status WriteManifest(const std::filesystem::path& dir,
                           const proto::TrainingCheckpointManifest& manifest);

// Reads and checks dir/manifest.binpb: InvalidArgument naming the file when
// it is missing its end (cut short), does not parse, or is of another format
// version; NotFound when absent.
absl::StatusOr<proto::TrainingCheckpointManifest> ReadManifest(const std::filesystem::path& dir);

// The complete checkpoints in `save_dir` (step-* directories whose manifest
// reads), by increasing step. Incomplete ones are skipped.
std::vector<std::pair<int64_t, std::filesystem::path>> ListCheckpoints(
    const std::filesystem::path& save_dir);

// The newest complete checkpoint in `save_dir`; NotFound naming it when none.
absl::StatusOr<std::filesystem::path> LatestCheckpoint(const std::filesystem::path& save_dir);

// Checks a file of the manifest against the disk without reading its tensor
// data: present (NotFound naming it otherwise), of the recorded size, and
// with the recorded header checksum (InvalidArgument naming it otherwise).
absl::Status CheckFileHeader(const std::filesystem::path& dir, const proto::CheckpointFile& file);

// Reads the whole file and checks its CRC-32 (offline verification).
absl::Status CheckWholeFile(const std::filesystem::path& dir, const proto::CheckpointFile& file);

}  // namespace moefit::checkpoint
