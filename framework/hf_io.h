// The model and Hugging Face model directories: loading pretrained weights into
// a (possibly expert-parallel) model, and writing it back out.
//
// Both go through the WeightConverter of checkpoint/ with the family's mapping
// table, so per-expert checkpoint tensors become the packed runtime tensors
// and back. Loading is rank-aware: each rank reads the dense tensors and only
// its own experts' bytes. Saving is collective: the ranks of the first
// expert-parallel group write the shards of their own experts (replicas hold
// the same values), world rank 0 the dense tensors, config.json and the index;
// everything is written under DIR.partial and renamed to DIR at the end, so an
// interrupted save never leaves a half-written DIR (a previous DIR survives
// until the new one is complete).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "checkpoint/weight_loader.h"
#include "framework/model.h"
#include "framework/model_options.h"
#include "parallel/process_groups.h"

namespace moefit::framework {

// What loading a checkpoint of a model with `options` needs whoever loads it:
// the FP8 block size and scale name of its quantization_config, its
// pack-quantized int4 scheme, and its multi-token-prediction layers
// [num_hidden_layers, + num_nextn_predict_layers) skipped by name.
void SetCheckpointFormat(const ModelOptions& options, checkpoint::LoadOptions& load);

// The name config.json gives a weight dtype: bfloat16, float16, or float32
// (which every other dtype is written as).
std::string DtypeName(at::ScalarType t);

// The dtype a frozen base loaded from the HF directory `dir` keeps: that of
// most of its weight matrices (checkpoint::StoredWeightDtype), with FP8
// dequantized to bfloat16 and float16 held as float32.
absl::StatusOr<at::ScalarType> CheckpointBaseDtype(const std::string& dir);

// Loads the weights of the HF directory `dir` into `model`. Missing,
// unexpected or mis-shaped tensors fail with one message naming them. Host
// tensors (the routed experts; the dense part on a CPU run) are filled in
// place by the loader, so the weights are held once: a model made with
// WeightInit::kUninitialized costs no more than its weights. Tensors on the
// GPU are loaded to the host and copied over once each.
absl::Status LoadPretrained(MoeModel& model, const std::string& dir,
                            checkpoint::LoadReport* report = nullptr);

// The config.json transformers reads for these options. When `base_config_json`
// is given (the model directory the weights came from), its other fields
// (token ids, rope scaling, ...) are kept.
std::string HfConfigJson(const ModelOptions& options, at::ScalarType dtype,
                         const std::string& base_config_json = "");

struct SaveOptions {
  uint64_t max_shard_bytes = 5'000'000'000;
  // Written dtype of floating tensors; nullopt keeps each parameter's.
  std::optional<at::ScalarType> dtype;
  std::string base_config_json;  // see HfConfigJson
  // A model directory whose other files (tokenizer, generation config, ...)
  // are copied along; empty = none.
  std::string copy_files_from;
};

// Collective over groups.world. Writes `model` as an HF directory at `dir`.
absl::Status SaveHfDirectory(const MoeModel& model, const std::string& dir,
                             const parallel::ProcessGroups& groups, const SaveOptions& options);

// What SaveHfDirectory writes, for callers without a model (moefit export).
struct HfTensors {
  std::string family;
  std::map<std::string, at::Tensor> tensors;  // runtime names; experts: this rank's slice
  int64_t first_expert = 0;       // global index of this rank's first expert
  int64_t num_global_experts = 0;
  bool writes = true;             // false on ranks that hold replicas of another's experts
  std::string config_json_text;   // written by world rank 0
  std::string copy_files_from;    // a model directory whose other files (tokenizer, ...) are copied
};
absl::Status SaveHfTensors(const HfTensors& in, const std::string& dir,
                           parallel::Communicator& world, const SaveOptions& options);

}  // namespace moefit::framework
