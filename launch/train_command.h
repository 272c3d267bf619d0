// `moefit train [CONFIG] [--set FIELD=VALUE]...`: builds the model and data
// from the resolved config and runs the trainer.
#pragma once

#include <ostream>

#include "absl/status/status.h"
#include "launch/config.h"

namespace moefit::launch {

absl::Status RunTraining(const RunConfig& run, std::ostream& log);

}  // namespace moefit::launch
