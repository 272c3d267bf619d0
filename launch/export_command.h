// `moefit export SRC DST`: rewrites a model directory in the standard Hugging
// Face layout (per-expert tensors, shards of at most --max_shard_bytes, the
// index, config.json and the other files of SRC), from any layout the family's
// mapping table reads (e.g. gpt-oss-style packed experts). A checkpoint tool:
// it builds no model. Under mpirun each rank reads and writes only its share
// of the experts; rank 0 the dense tensors and the index.
//
// SRC may also be a training checkpoint (a step-* directory with
// manifest.binpb, framework/training_checkpoint.h): the model of its recorded
// config is then built at this world size, its trained tensors read (each rank
// its own experts), and written as the run's final save would (a PEFT adapter
// directory for a LoRA run, whose base comes from its model.model_path).
#pragma once

#include <memory>
#include <optional>
#include <ostream>
#include <string>

#include <c10/core/ScalarType.h>

#include "absl/status/status.h"
#include "parallel/communicator.h"

namespace moefit::launch {

struct ExportCommandOptions {
  int64_t max_shard_bytes = 0;  // --max_shard_bytes, else checkpoint.max_shard_bytes's default
  std::optional<at::ScalarType> dtype;
};

absl::Status RunExport(const std::string& src, const std::string& dst,
                       const ExportCommandOptions& options,
                       std::shared_ptr<parallel::Communicator> world, std::ostream& log);

}  // namespace moefit::launch
