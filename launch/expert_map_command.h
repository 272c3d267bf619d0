// `moefit expert-map RUN_DIR [--step N] [--out FILE]`: draws the expert map
// (framework/expert_map.h) again from a run's metrics file, without the
// model: the decayed per-expert loads of step N (default: the last step
// written) as the trainer drew them, pixel for pixel.
//
// RUN_DIR is the metrics file itself (logging.metrics_file) or the
// directory holding it: its moefit-metrics.jsonl, else its only *.jsonl
// file. The map goes to FILE, default expert-map.png beside the metrics
// file. A step written twice (a run resumed from a checkpoint before it)
// is drawn from its last line.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moefit::launch {

struct ExpertMapCommandOptions {
  int64_t step = 0;  // 0 = the last step in the file
  std::string out;   // empty = expert-map.png beside the metrics file
};

// The metrics file RUN_DIR names; NotFound / InvalidArgument naming it.
absl::StatusOr<std::string> FindMetricsFile(const std::string& run_dir);

absl::Status RunExpertMapCommand(const std::string& run_dir, const ExpertMapCommandOptions& options,
                                 std::ostream& log);

}  // namespace moefit::launch
