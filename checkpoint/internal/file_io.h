// Whole-file reads and crash-safe whole-file writes for checkpoint files (internal).
//
// A checkpoint file is either complete or absent: writers put the bytes in
// `<path>.tmp`, fsync it, rename it over `path` (atomic on POSIX filesystems)
// and fsync the directory so the rename itself survives a power cut. A crash
// at any point leaves the previous file, or none, under the real name, plus at
// worst a stale `.tmp` that the next write truncates.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moefit::checkpoint::internal {

// Writes the concatenation of `parts` to `path` as described above. With
// `sync` false the fsyncs are skipped (throwaway files in tests). On failure the
// temporary file is removed and the message names the file.
absl::Status WriteFileAtomically(const std::filesystem::path& path,
                                 std::span<const std::span<const std::byte>> parts, bool sync);

// The whole file as a string (for small text files such as JSON indexes).
absl::StatusOr<std::string> ReadFileToString(const std::filesystem::path& path);

}  // namespace moefit::checkpoint::internal
