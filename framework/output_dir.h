// Output directories that appear whole or not at all: everything is written
// under DIR.partial (the files moefit writes fsynced), the directory fsynced,
// and the finished directory renamed to DIR (an older DIR survives until the
// new one is complete, as DIR.old for the moment between the two renames).
#pragma once

#include <filesystem>
#include <string>

#include "absl/status/status.h"
#include "parallel/communicator.h"

namespace moefit::framework {

// The staging path of `dir` (DIR.partial), emptied and created.
absl::Status StageDirectory(const std::filesystem::path& dir, std::filesystem::path* partial);

// Writes `text` to `path` through `path`.tmp, fsynced, then renamed.
absl::Status WriteTextFile(const std::filesystem::path& path, const std::string& text);

// Moves the complete staging directory `partial` to `dir`, replacing an older
// `dir`, and fsyncs the parent directory.
absl::Status PublishDirectory(const std::filesystem::path& partial,
                              const std::filesystem::path& dir);

// Collective over `comm`: whether any rank reports failure (every rank gets
// the same answer, so that all return together).
bool AnyRankFailed(parallel::Communicator& comm, bool failed);

}  // namespace moefit::framework
