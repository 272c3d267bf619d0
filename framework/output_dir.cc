// Whole-or-nothing output directories; see output_dir.h.
#include "framework/output_dir.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moefit::framework {
namespace {

namespace fs = std::filesystem;

absl::Status Errno(const std::string& what, const fs::path& path) {
  return absl::InternalError(
      absl::StrCat("cannot ", what, " ", path.string(), ": ", std::strerror(errno)));
}

absl::Status SyncPath(const fs::path& path, int flags) {
  const int fd = ::open(path.c_str(), flags);
  if (fd < 0) return Errno("open", path);
  const bool ok = ::fsync(fd) == 0;
  ::close(fd);
  return ok ? absl::OkStatus() : Errno("fsync", path);
}

}  // namespace

absl::Status StageDirectory(const fs::path& dir, fs::path* partial) {
  *partial = fs::path(dir.lexically_normal().string() + ".partial");
  std::error_code ec;
  fs::remove_all(*partial, ec);
  if (!ec) fs::create_directories(*partial, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot create ", partial->string(), ": ", ec.message()));
  }
  return absl::OkStatus();
}

absl::Status WriteTextFile(const fs::path& path, const std::string& text) {
  const fs::path tmp = fs::path(path.string() + ".tmp");
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("create", tmp);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      absl::Status s = Errno("write", tmp);
      ::close(fd);
      return s;
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    absl::Status s = Errno("fsync", tmp);
    ::close(fd);
    return s;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) return Errno("rename", tmp);
  return absl::OkStatus();
}

absl::Status PublishDirectory(const fs::path& partial, const fs::path& dir_in) {
  const fs::path dir = dir_in.lexically_normal();
  absl::Status s = SyncPath(partial, O_RDONLY | O_DIRECTORY);
  if (!s.ok()) return s;
  std::error_code ec;
  const fs::path old = fs::path(dir.string() + ".old");
  fs::remove_all(old, ec);
  if (fs::exists(dir)) fs::rename(dir, old, ec);
  if (!ec) fs::rename(partial, dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot move ", partial.string(), " to ", dir.string(), ": ", ec.message()));
  }
  fs::path parent = dir.parent_path();
  if (parent.empty()) parent = ".";
  s = SyncPath(parent, O_RDONLY | O_DIRECTORY);
  fs::remove_all(old, ec);
  return s;
}

bool AnyRankFailed(parallel::Communicator& comm, bool failed) {
  at::Tensor flag = at::full({1}, failed ? 1 : 0, at::kLong);
  comm.AllReduce(flag, parallel::ReduceOp::kMax)->WaitOrThrow();
  return flag.item<int64_t>() != 0;
}

}  // namespace moefit::framework
