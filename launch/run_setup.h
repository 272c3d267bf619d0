// What every command that runs a model starts from: the model of a resolved
// config on a communicator (its process groups, this rank's experts, the
// checkpoint's weights, the expert dtype the checkpoint and the mode imply)
// and the config's data. Shared by train, eval, export, merge and
// routing-report.
#pragma once

#include <memory>
#include <ostream>

#include "absl/status/statusor.h"
#include "framework/data.h"
#include "framework/model.h"
#include "launch/config.h"
#include "parallel/communicator.h"
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

}  // namespace moefit::launch
