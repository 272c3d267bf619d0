// POSIX implementation of the checkpoint file helpers (see file_io.h).
//
// Plain file descriptors rather than iostreams: the error paths need errno,
// writes of many GB must loop over partial write(2)s, and fsync needs the fd.
#include "checkpoint/internal/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"

namespace moefit::checkpoint::internal {
namespace {

// write(2) until everything is written.
absl::Status WriteAll(int fd, std::span<const std::byte> bytes, const std::string& name) {
  while (!bytes.empty()) {
    const ssize_t written = ::write(fd, bytes.data(), bytes.size());
    if (written < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, absl::StrCat(name, ": write failed"));
    }
    bytes = bytes.subspan(static_cast<size_t>(written));
  }
  return absl::OkStatus();
}

// Makes a rename in `dir` durable. Filesystems that cannot sync a directory
// report EINVAL; there is nothing more to do on them, so that is not an error.
absl::Status SyncDirectory(const std::filesystem::path& dir) {
  const std::string name = dir.empty() ? std::string(".") : dir.string();
  const int fd = ::open(name.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat(name, ": cannot open directory"));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) {
    return absl::ErrnoToStatus(err, absl::StrCat(name, ": cannot sync directory"));
  }
  return absl::OkStatus();
}

absl::Status WriteTemporary(const std::string& tmp_name,
                            std::span<const std::span<const std::byte>> parts, bool sync) {
  const int fd = ::open(tmp_name.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat(tmp_name, ": cannot create"));
  absl::Status status;
  for (size_t part_idx = 0; status.ok() && part_idx < parts.size(); ++part_idx) {
    status = WriteAll(fd, parts[part_idx], tmp_name);
  }
  if (status.ok() && sync && ::fsync(fd) != 0) {
    status = absl::ErrnoToStatus(errno, absl::StrCat(tmp_name, ": fsync failed"));
  }
  if (::close(fd) != 0 && status.ok()) {
    status = absl::ErrnoToStatus(errno, absl::StrCat(tmp_name, ": close failed"));
  }
  return status;
}

}  // namespace

absl::Status WriteFileAtomically(const std::filesystem::path& path,
                                 std::span<const std::span<const std::byte>> parts, bool sync) {
  std::filesystem::path tmp_path = path;
  tmp_path += ".tmp";
  const std::string tmp_name = tmp_path.string();
  absl::Status status = WriteTemporary(tmp_name, parts, sync);
  if (!status.ok()) {
    ::unlink(tmp_name.c_str());
    return status;
  }
  if (::rename(tmp_name.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_name.c_str());
    return absl::ErrnoToStatus(
        err, absl::StrCat(path.string(), ": cannot rename ", tmp_name, " over it"));
  }
  if (sync) return SyncDirectory(path.parent_path());
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFileToString(const std::filesystem::path& path) {
  const std::string name = path.string();
  const int fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat(name, ": cannot open"));
  std::string contents;
  char buffer[1 << 16];
  while (true) {
    const ssize_t num_read = ::read(fd, buffer, sizeof(buffer));
    if (num_read < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return absl::ErrnoToStatus(err, absl::StrCat(name, ": read failed"));
    }
    if (num_read == 0) break;
    contents.append(buffer, static_cast<size_t>(num_read));
  }
  ::close(fd);
  return contents;
}

}  // namespace moefit::checkpoint::internal
