// The reshard command; see reshard_command.h.
#include "launch/reshard_command.h"

#include <filesystem>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/training_manifest.h"
#include "checkpoint/training_reshard.h"
#include "framework/output_dir.h"
#include "framework/training_checkpoint.h"
#include "proto/status_macros.h"

namespace moefit::launch {
namespace fs = std::filesystem;

absl::Status RunReshard(const std::string& in, const std::string& out, int ep_size,
                        std::shared_ptr<parallel::Communicator> world, std::ostream& log_in) {
  std::ostringstream discard;
  std::ostream& log = world->rank() == 0 ? log_in : discard;
  if (ep_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--ep = ", ep_size, " must be >= 1"));
  }
  std::error_code ec;
  if (fs::weakly_canonical(in, ec) == fs::weakly_canonical(out, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("reshard: OUT = '", out, "' is IN; choose another directory"));
  }
  // Every rank reads the manifest; a bad one fails on all ranks alike.
  MOEFIT_ASSIGN_OR_RETURN(proto::TrainingCheckpointManifest manifest, checkpoint::ReadManifest(in));
  const int64_t num_experts =
      manifest.layout().expert_first_size() > 0
          ? manifest.layout().expert_first(manifest.layout().expert_first_size() - 1)
          : 0;
  if (ep_size > num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ep = ", ep_size, " is more than the ", num_experts, " experts of ", in));
  }
  fs::path partial;
  absl::Status status;
  if (world->rank() == 0) status = framework::StageDirectory(out, &partial);
  if (framework::AnyRankFailed(*world, !status.ok())) {
    return status.ok() ? absl::InternalError("reshard: rank 0 failed") : status;
  }
  partial = fs::path(fs::path(out).lexically_normal().string() + ".partial");
  std::vector<proto::CheckpointFile> mine;
  if (world->rank() == 0) {
    absl::StatusOr<proto::CheckpointFile> dense = checkpoint::CopyDenseFile(in, manifest, partial);
    if (dense.ok()) {
      mine.push_back(std::move(*dense));
    } else {
      status = dense.status();
    }
  }
  for (int r = world->rank(); r < ep_size && status.ok(); r += world->size()) {
    absl::StatusOr<proto::CheckpointFile> f =
        checkpoint::WriteReshardedExpertFile(in, manifest, partial, r, ep_size);
    if (f.ok()) {
      mine.push_back(std::move(*f));
    } else {
      status = f.status();
    }
  }
  if (framework::AnyRankFailed(*world, !status.ok())) {
    return status.ok() ? absl::InternalError("reshard: another rank failed") : status;
  }
  std::vector<proto::CheckpointFile> files = framework::GatherCheckpointFiles(*world, mine);
  if (world->rank() == 0) {
    status = [&]() -> absl::Status {
      MOEFIT_ASSIGN_OR_RETURN(proto::TrainingCheckpointManifest resharded,
                              checkpoint::ReshardedManifest(manifest, std::move(files), ep_size));
      MOEFIT_RETURN_IF_ERROR(checkpoint::WriteManifest(partial, resharded));
      return framework::PublishDirectory(partial, out);
    }();
  }
  if (framework::AnyRankFailed(*world, !status.ok())) {
    return status.ok() ? absl::InternalError("reshard: rank 0 failed") : status;
  }
  log << "moefit: resharded " << in << " (" << manifest.layout().ep_size() << " expert ranks) to "
      << out << " (" << ep_size << ")" << std::endl;
  return absl::OkStatus();
}

}  // namespace moefit::launch
