// Offline resharding of training checkpoints; see training_reshard.h.
#include "checkpoint/training_reshard.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/training_manifest.h"
#include "proto/status_macros.h"
#include "router/expert_placement.h"

namespace moefit::checkpoint {
namespace {

namespace fs = std::filesystem;

constexpr char kDenseFile[] = "dense.safetensors";

bool IsExpertFile(const proto::CheckpointFile& f) { return f.path().starts_with("experts-"); }

int64_t NumExperts(const proto::TrainingCheckpointManifest& in) {
  return in.layout().expert_first_size() > 0
             ? in.layout().expert_first(in.layout().expert_first_size() - 1)
             : 0;
}

}  // namespace

absl::StatusOr<proto::CheckpointFile> WriteReshardedExpertFile(
    const fs::path& in_dir, const proto::TrainingCheckpointManifest& in, const fs::path& out_dir,
    int out_rank, int ep_size) {
  MOEFIT_ASSIGN_OR_RETURN(router::ExpertPlacement placement,
                          router::ExpertPlacement::Contiguous(NumExperts(in), ep_size));
  const int64_t first = placement.first_expert(out_rank);
  const int64_t end = first + placement.num_local(out_rank);
  // Input slabs per tensor name, in the order the first input file lists them.
  std::vector<std::string> names;
  std::map<std::string,
           std::vector<std::pair<const proto::CheckpointFile*, const proto::CheckpointTensor*>>>
      slabs;
  std::map<std::string, SafetensorsFile> open;
  for (const proto::CheckpointFile& f : in.files()) {
    if (!IsExpertFile(f)) continue;
    for (const proto::CheckpointTensor& t : f.tensors()) {
      if (!slabs.count(t.name())) names.push_back(t.name());
      slabs[t.name()].emplace_back(&f, &t);
    }
  }
  proto::CheckpointFile out;
  out.set_path(absl::StrFormat("experts-%05d-of-%05d.safetensors", out_rank, ep_size));
  out.set_written_by_rank(out_rank);
  SafetensorsWriter writer(out_dir / out.path());
  uint32_t data_crc = 0;
  uint64_t data_bytes = 0;
  for (const std::string& name : names) {
    const proto::CheckpointTensor* like = slabs[name].front().second;
    proto::CheckpointTensor* e = out.add_tensors();
    e->set_name(name);
    e->set_dtype(like->dtype());
    e->set_adam_step(like->adam_step());
    e->set_expert_begin(first);
    e->set_expert_end(end);
    std::vector<int64_t> shape(like->shape().begin(), like->shape().end());
    shape[0] = end - first;
    for (int64_t d : shape) e->add_shape(d);
    std::vector<std::byte> rows;
    int64_t covered = 0;
    uint32_t crc = 0;
    for (const auto& [file, t] : slabs[name]) {
      const int64_t b = std::max(first, t->expert_begin());
      const int64_t x_end = std::min(end, t->expert_end());
      if (b >= x_end) continue;
      if (t->adam_step() != like->adam_step()) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", name, ": its expert files disagree on the AdamW step"));
      }
      auto it = open.find(file->path());
      if (it == open.end()) {
        MOEFIT_RETURN_IF_ERROR(CheckFileHeader(in_dir, *file));
        MOEFIT_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Open(in_dir / file->path()));
        it = open.emplace(file->path(), std::move(f)).first;
      }
      MOEFIT_ASSIGN_OR_RETURN(std::span<const std::byte> bytes, it->second.TensorBytes(name));
      const int64_t num = t->expert_end() - t->expert_begin();
      const size_t row = bytes.size() / static_cast<size_t>(num);
      for (int64_t x = b; x < x_end; ++x) {
        const int64_t i = x - t->expert_begin();
        std::span<const std::byte> r = bytes.subspan(static_cast<size_t>(i) * row, row);
        if (t->expert_crc32_size() != num || Crc32(r) != t->expert_crc32(static_cast<int>(i))) {
          return absl::InvalidArgumentError(absl::StrCat("checksum mismatch in checkpoint file ",
                                                         (in_dir / file->path()).string(),
                                                         ": tensor ", name, " (expert ", x, ")"));
        }
        rows.insert(rows.end(), r.begin(), r.end());
        e->add_expert_crc32(t->expert_crc32(static_cast<int>(i)));
        crc = Crc32Combine(crc, t->expert_crc32(static_cast<int>(i)), row);
      }
      covered += x_end - b;
    }
    if (covered != end - first) {
      return absl::NotFoundError(absl::StrCat("the checkpoint ", in_dir.string(),
                                              " lacks experts of ", name,
                                              " (an expert file is missing)"));
    }
    e->set_crc32(crc);
    data_crc = Crc32Combine(data_crc, crc, rows.size());
    data_bytes += rows.size();
    std::optional<Dtype> dtype = DtypeFromName(like->dtype());
    if (!dtype) return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": bad dtype"));
    MOEFIT_RETURN_IF_ERROR(writer.AddCopy(name, *dtype, shape, rows));
  }
  MOEFIT_RETURN_IF_ERROR(writer.Finish());
  MOEFIT_RETURN_IF_ERROR(CompleteFileEntry(out_dir, data_bytes, data_crc, &out));
  return out;
}

absl::StatusOr<proto::CheckpointFile> CopyDenseFile(const fs::path& in_dir,
                                                    const proto::TrainingCheckpointManifest& in,
                                                    const fs::path& out_dir) {
  for (const proto::CheckpointFile& f : in.files()) {
    if (f.path() != kDenseFile) continue;
    MOEFIT_RETURN_IF_ERROR(CheckWholeFile(in_dir, f));
    std::error_code ec;
    fs::copy_file(in_dir / f.path(), out_dir / f.path(), fs::copy_options::overwrite_existing, ec);
    if (ec) {
      return absl::InternalError(
          absl::StrCat("cannot copy ", (in_dir / f.path()).string(), ": ", ec.message()));
    }
    const int fd = ::open((out_dir / f.path()).c_str(), O_RDONLY | O_CLOEXEC);
    const bool synced = fd >= 0 && ::fsync(fd) == 0;
    if (fd >= 0) ::close(fd);
    if (!synced) {
      return absl::InternalError(absl::StrCat("cannot fsync ", (out_dir / f.path()).string()));
    }
    proto::CheckpointFile out = f;
    out.set_written_by_rank(0);
    return out;
  }
  return absl::NotFoundError(
      absl::StrCat("the manifest of ", in_dir.string(), " lists no ", kDenseFile));
}

absl::StatusOr<proto::TrainingCheckpointManifest> ReshardedManifest(
    const proto::TrainingCheckpointManifest& in, std::vector<proto::CheckpointFile> files,
    int ep_size) {
  MOEFIT_ASSIGN_OR_RETURN(router::ExpertPlacement placement,
                          router::ExpertPlacement::Contiguous(NumExperts(in), ep_size));
  proto::TrainingCheckpointManifest out = in;
  out.clear_files();
  for (proto::CheckpointFile& f : files) *out.add_files() = std::move(f);
  proto::CheckpointLayout* layout = out.mutable_layout();
  layout->set_world_size(ep_size);
  layout->set_ep_size(ep_size);
  layout->clear_expert_first();
  for (int r = 0; r < ep_size; ++r) layout->add_expert_first(placement.first_expert(r));
  layout->add_expert_first(placement.num_experts());
  return out;
}

}  // namespace moefit::checkpoint
