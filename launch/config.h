// Loading and resolving the training config.
//
// The edge where protobuf stops: a text-format file is merged onto the
// built-in defaults, `--set path.to.field=value` overrides are applied through
// protobuf reflection, an HF config.json (model.config_json) fills the model
// fields the file left unset, and the result is checked and resolved into the
// plain option structs the framework takes. Every error names the field (or
// file and line) and the value, on one line.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "framework/model.h"
#include "framework/model_options.h"
#include "framework/trainer.h"
#include "proto/config.pb.h"

namespace moefit::launch {

// The configuration `moefit train` runs without a CONFIG argument: a tiny
// Qwen3-MoE-shaped model on the corpus shipped with moefit.
extern const char kDemoConfig[];

// The built-in defaults of every field but the model's.
proto::Config DefaultConfig();

// Reads `path` (empty = the demo config) merged onto the defaults, then
// applies each "path.to.field=value" override in order, then merges the
// model's config_json. InvalidArgument / NotFound on bad input.
absl::StatusOr<proto::Config> LoadConfig(const std::string& path,
                                         const std::vector<std::string>& overrides);

// The same for config text from `source` (a name for messages) instead of a file.
absl::StatusOr<proto::Config> LoadConfigText(const std::string& text, const std::string& source,
                                             const std::vector<std::string>& overrides);

// Applies one "path.to.field=value" override (exposed for tests).
absl::Status ApplyOverride(const std::string& assignment, proto::Config* config);

// Fills `model` from an HF config.json: fields the model already has win.
// Every key of the file is used, or on the ignore list of config.cc (also in
// the README), or an error naming it; values moefit does not implement (a
// rope_scaling type, a non-silu activation, dropout, sliding windows) are
// errors too.
absl::Status MergeHfConfigJson(const std::string& path, proto::ModelConfig* model);

struct DataSpec {
  std::string format;  // "text" or "jsonl"
  std::string path;    // empty with "text" = the shipped corpus
};

// A resolved config: every field is filled by ResolveConfig (the defaults and
// ranges are those of proto/config.proto).
struct RunConfig {
  framework::ModelOptions model;
  framework::ModelRuntime runtime;
  framework::TrainOptions train;
  int64_t seq_len = 0;
  int ep_size = 0;  // 0 = the world
  // Processes of a node that may share one GPU (parallel/node_devices.h).
  int ranks_per_gpu = 0;
  DataSpec data;
  std::string model_path;        // pretrained weights; empty = random init
  std::string base_config_json;  // config.json the shape came from, if any
  std::string save_dir;          // HF directory written at the end; empty = none
  int64_t max_shard_bytes = 0;
  std::optional<at::ScalarType> save_dtype;
  // LoRA (runtime.lora.enabled()): the adapter to start from or to apply
  // (empty = a new one), and whether saves also write the per-expert layout.
  std::string lora_init_from;
  bool lora_adapter_only = false;  // lora.adapter_path: applied, not trained (eval, merge)
  bool lora_save_per_expert = false;
  // Frozen-base dtype (lora.base_dtype); nullopt = the checkpoint's.
  std::optional<at::ScalarType> lora_base_dtype;
  bool experts_dtype_set = false;  // experts.dtype given (it then wins for the experts)
  // Training checkpoints (framework/training_checkpoint.h): periods (0 = off),
  // how many to keep (0 = all), and the checkpoint to resume from ("" = none,
  // a directory, or "latest").
  int64_t save_every_steps = 0;
  double save_every_minutes = 0;
  int64_t keep_last = 0;
  std::string resume_from;
  // The weights come from the resumed checkpoint: the model is only allocated
  // (set by the train command when resuming in full mode).
  bool weights_from_checkpoint = false;
  // The resolved config as text (recorded in training checkpoints, and what
  // every rank of a job must agree on), and its model section (compared on
  // resume).
  std::string config_text;
  proto::ModelConfig model_config;

  bool training_checkpoints() const { return save_every_steps > 0 || save_every_minutes > 0; }
  // Collective deadlines (parallel.timeout_s, parallel.startup_timeout_s).
  double timeout_s = 0;
  double startup_timeout_s = 0;
  // An MPI progress thread polling every this many microseconds while
  // collectives are in flight (parallel.progress_thread_us); 0 = none.
  int64_t progress_thread_us = 0;
};

// Resolves the model fields alone: family defaults, then every check. What
// tools that need the shape but no run (moefit plan) call.
absl::StatusOr<framework::ModelOptions> ResolveModelConfig(const proto::ModelConfig& model);

// Checks every field and resolves the family defaults.
absl::StatusOr<RunConfig> ResolveConfig(const proto::Config& config);

}  // namespace moefit::launch
