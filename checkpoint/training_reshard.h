// Offline resharding of a training checkpoint to another expert-parallel
// degree, at the level of bytes: no model is built and no tensor is
// interpreted, so it runs as a checkpoint tool (`moefit reshard`).
//
// The expert files of the output are those a run at ep_size ranks with the
// contiguous placement would write: output rank r holds, for every expert
// tensor of the input (parameters and AdamW moments), the rows of its global
// experts, gathered from whichever input files hold them, each expert's
// checksum checked as it is read (the per-expert checksums carry over, since
// the bytes do). The dense file is copied as it is; generator states are not
// carried (they belong to ranks of the saved layout; a resumed run reseeds
// them). Writing the output ranks' files is independent, so processes can
// share it (launch/reshard_command.h).
#pragma once

#include <filesystem>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/training_checkpoint.pb.h"

namespace moefit::checkpoint {

// Writes output rank `out_rank` of `ep_size`'s expert file of the checkpoint
// `in_dir` (manifest `in`) into `out_dir`; returns its manifest entry.
absl::StatusOr<proto::CheckpointFile> WriteReshardedExpertFile(
    const std::filesystem::path& in_dir, const proto::TrainingCheckpointManifest& in,
    const std::filesystem::path& out_dir, int out_rank, int ep_size);

// Copies the dense file of `in_dir` into `out_dir` after checking its
// whole-file checksum; returns its (unchanged) entry.
absl::StatusOr<proto::CheckpointFile> CopyDenseFile(const std::filesystem::path& in_dir,
                                                    const proto::TrainingCheckpointManifest& in,
                                                    const std::filesystem::path& out_dir);

// The output manifest: `in`'s, with `files` (the dense file and every output
// expert file) and the layout of ep_size ranks (world size ep_size).
absl::StatusOr<proto::TrainingCheckpointManifest> ReshardedManifest(
    const proto::TrainingCheckpointManifest& in, std::vector<proto::CheckpointFile> files,
    int ep_size);

}  // namespace moefit::checkpoint
