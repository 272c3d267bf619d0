// Training checkpoints: everything a run needs to continue exactly where it
// stopped, saved every so many steps or minutes, on SIGTERM/SIGINT and at the
// end, and restored at the same or another world size.
//
// A checkpoint is a directory save_dir/step-NNNNNNNN (N = steps done) of
// safetensors files and a manifest (checkpoint/training_manifest.h):
//   dense.safetensors        world rank 0: the dense trainable tensors
//                            ("param/<name>"), their AdamW moments
//                            ("exp_avg/<name>", "exp_avg_sq/<name>"), and the
//                            routers' correction biases ("buffer/<name>");
//   experts-RRRRR-of-EEEEE.safetensors
//                            expert-parallel rank R of E (the first copy of
//                            the experts): its packed expert tensors and
//                            their moments, rows = its global experts, which
//                            the manifest records;
//   rng-RRRRR.safetensors    each world rank: its generators' states.
// Trainable means the optimizer's tensors: every weight (float32 masters of
// bfloat16 experts included), or only the LoRA adapters in train.mode lora,
// whose frozen base comes again from model.model_path (or the seed).
//
// Each rank writes its own files in parallel; no rank ever holds another's
// experts. Rank 0 publishes the directory (rename from a hidden temporary
// name, directories fsynced) only after every rank reports its files written,
// and deletes checkpoints beyond keep_last only after that, so a failure or a
// kill at any moment leaves the previous checkpoint whole.
//
// Loading is by global expert index: a rank reads, from the mapped files, only
// the rows of the experts it owns under the current placement (checking the
// per-expert checksums of exactly those rows), so a checkpoint saved at one
// world size or expert-parallel degree resumes at any other. Same world size:
// losses continue bit for bit. Another world size: the generator states cannot
// follow the ranks (each rank's generator is then reseeded from the seed, its
// rank and the step, which matters only for LoRA dropout).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "framework/trainer.h"
#include "parallel/communicator.h"
#include "proto/config.pb.h"
#include "proto/training_checkpoint.pb.h"

namespace moefit::framework {

struct CheckpointingOptions {
  std::string save_dir;
  int64_t save_every_steps = 0;   // 0 = not by steps
  double save_every_minutes = 0;  // 0 = not by time
  int64_t keep_last = 0;          // 0 = keep all
  // Recorded in the manifest: the resolved config (text format) and its model
  // section, which a resumed run must match.
  std::string config_text;
  proto::ModelConfig model_config;
};

// Writes the trainer's state after `steps_done` steps as
// save_dir/step-NNNNNNNN. Collective over the trainer's world; every rank
// returns the same success or failure.
absl::Status SaveTrainingCheckpoint(Trainer& trainer, int64_t steps_done,
                                    const CheckpointingOptions& options);

// Restores the trainer (weights, AdamW states, correction biases, generator
// states, next step) from checkpoint `dir`, each rank reading only its own
// experts. `model_config`, if given, must equal the manifest's model section
// (paths aside). Errors (InvalidArgument / NotFound, naming the file, tensor or
// field): checksum mismatch, missing file or tensor, truncated or
// other-version manifest, another model, another train.mode, other data or
// global batch. Collective; returns the step to continue from.
absl::StatusOr<int64_t> LoadTrainingCheckpoint(Trainer& trainer, const std::filesystem::path& dir,
                                               const proto::ModelConfig* model_config = nullptr);

// Collective: every rank's file entries, on every rank, in rank order (a
// byte all-gather of the serialized entries).
std::vector<proto::CheckpointFile> GatherCheckpointFiles(
    parallel::Communicator& world, const std::vector<proto::CheckpointFile>& mine);

// The trained tensors and buffers of checkpoint `dir` into `model` (whose
// experts are those of expert-parallel rank `ep_rank`), without optimizer,
// data or generator state: what exporting a checkpoint as a model needs.
// Not collective. Returns the checkpoint's step.
absl::StatusOr<int64_t> LoadCheckpointWeights(MoeModel& model, int ep_rank,
                                              const std::filesystem::path& dir);

// checkpoint.resume_from: a directory, or "latest" (the newest complete
// checkpoint in save_dir).
absl::StatusOr<std::filesystem::path> ResolveResumeDir(const std::string& resume_from,
                                                       const std::string& save_dir);

// SIGTERM and SIGINT set a flag instead of ending the process; the
// checkpointer stops the run after the current step, with a checkpoint.
void InstallStopSignalHandlers();
// As if a stop signal had arrived (tests; one rank suffices).
void RequestStop();
bool StopRequested();
// Clears the flag (tests).
void ClearStopRequest();

// The trainer's StepEndHook that saves on schedule: every save_every_steps
// steps, when save_every_minutes have passed since the last save (rank 0's
// clock), after the last step, and when any rank has a stop request (then the
// run stops). The decision is all-reduced each step, so all ranks agree.
class Checkpointer {
 public:
  Checkpointer(Trainer& trainer, CheckpointingOptions options, std::ostream& log);
  StepEndHook Hook();
  // Whether the run was stopped by a stop request, and the last step saved (-1: none).
  bool stopped() const { return stopped_; }
  int64_t last_saved_step() const { return last_saved_; }

 private:
  absl::StatusOr<bool> AtStepEnd(int64_t steps_done);

  Trainer& trainer_;
  CheckpointingOptions options_;
  std::ostream& log_;
  double last_save_time_ = 0;  // seconds on a steady clock
  bool stopped_ = false;
  int64_t last_saved_ = -1;
};

}  // namespace moefit::framework
