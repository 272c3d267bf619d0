// `moefit merge BASE ADAPTER OUT`: folds a LoRA adapter (PEFT format) into its
// base model and writes the merged model as a Hugging Face model directory
// that transformers loads without peft. Every adapted weight becomes
// W + scaling·B·A, computed in float32 and rounded once to the written dtype
// (the base checkpoint's unless --save_dtype says otherwise). Under mpirun each
// rank loads and merges only its own experts.
#pragma once

#include <c10/core/ScalarType.h>

#include <memory>
#include <optional>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "parallel/communicator.h"

namespace moefit::launch {

struct MergeCommandOptions {
  int64_t max_shard_bytes = 0;  // --max_shard_bytes, else checkpoint.max_shard_bytes's default
  std::optional<at::ScalarType> dtype;  // nullopt: the base checkpoint's
};

absl::Status RunMerge(const std::string& base, const std::string& adapter, const std::string& out,
                      const MergeCommandOptions& options,
                      std::shared_ptr<parallel::Communicator> world, std::ostream& log);

}  // namespace moefit::launch
