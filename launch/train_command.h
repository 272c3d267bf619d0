// `moefit train [CONFIG] [--set FIELD=VALUE]...`: builds the model and data
// from the resolved config (launch/run_setup.h) and runs the trainer.
#pragma once

#include <memory>
#include <ostream>

#include "absl/status/status.h"
#include "launch/config.h"
#include "parallel/communicator.h"

namespace moefit::launch {

// `world` is MPI's world under mpirun, else a one-rank local communicator.
// Only world rank 0 writes to `log`.
absl::Status RunTraining(const RunConfig& run, std::shared_ptr<parallel::Communicator> world,
                         std::ostream& log);

}  // namespace moefit::launch
