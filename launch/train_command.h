// `moefit train [CONFIG] [--set FIELD=VALUE]...`: builds the model and data
// from the resolved config and runs the trainer.
#pragma once

#include <memory>
#include <ostream>

#include "absl/status/status.h"
#include "framework/data.h"
#include "framework/model.h"
#include "launch/config.h"
#include "parallel/communicator.h"
#include "parallel/node_devices.h"
#include "parallel/process_groups.h"

namespace moefit::launch {

// The model of a run on `world`: the process groups of parallel.ep_size
// (errors name the field), the model with this rank's experts, and the
// weights of model.model_path if given (reported on `log`), loaded into the
// model's own tensors. Collective: ends by logging the memory breakdown
// (launch/memory_report.h) of rank 0 and the largest over the ranks.
struct ParallelModel {
  parallel::ProcessGroups groups;
  std::unique_ptr<framework::MoeModel> model;
  // With the dense layers on a GPU: whether every process of this node has
  // one of its own (parallel/node_devices.h).
  bool gpu_per_process = false;
};
absl::StatusOr<ParallelModel> BuildModel(const RunConfig& run,
                                         std::shared_ptr<parallel::Communicator> world,
                                         std::ostream& log);

// The config's data: a JSON Lines file, a text file, or the shipped corpus.
absl::StatusOr<framework::TokenDataset> LoadDataset(const RunConfig& run);

// `world` is MPI's world under mpirun, else a one-rank local communicator.
// Only world rank 0 writes to `log`.
absl::Status RunTraining(const RunConfig& run, std::shared_ptr<parallel::Communicator> world,
                         std::ostream& log);

}  // namespace moefit::launch
