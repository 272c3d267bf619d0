// `moefit train [CONFIG] [--set FIELD=VALUE]...`: builds the model and data
// from the resolved config and runs the trainer.
#pragma once

#include <ostream>

#include "absl/status/status.h"
#include "framework/data.h"
#include "launch/config.h"
#include "parallel/communicator.h"
#include "parallel/process_groups.h"

namespace moefit::launch {

// The process groups of parallel.ep_size over `world` (errors name the field).
absl::StatusOr<parallel::ProcessGroups> MakeGroups(const RunConfig& run,
                                                   std::shared_ptr<parallel::Communicator> world);

// The config's data: a JSON Lines file, a text file, or the shipped corpus.
absl::StatusOr<framework::TokenDataset> LoadDataset(const RunConfig& run);

// `world` is MPI's world under mpirun, else a one-rank local communicator.
// Only world rank 0 writes to `log`.
absl::Status RunTraining(const RunConfig& run, std::shared_ptr<parallel::Communicator> world,
                         std::ostream& log);

}  // namespace moefit::launch
