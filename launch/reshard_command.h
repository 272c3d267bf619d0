// `moefit reshard IN OUT --ep M`: rewrites the training checkpoint IN as the
// checkpoint a run at M expert-parallel ranks would have saved (OUT), without
// building the model (checkpoint/training_reshard.h). Under mpirun the M
// output expert files are shared among the processes (output rank r written
// by process r mod world size); rank 0 copies the dense file, writes the
// manifest and publishes OUT whole, as a training save does. Resuming
// directly from IN at M ranks reads the same bytes; resharding ahead of time
// only saves each rank from opening the files of the old layout.
#pragma once

#include <memory>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "parallel/communicator.h"

namespace moefit::launch {

absl::Status RunReshard(const std::string& in, const std::string& out, int ep_size,
                        std::shared_ptr<parallel::Communicator> world, std::ostream& log);

}  // namespace moefit::launch
