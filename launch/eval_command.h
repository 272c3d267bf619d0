// `moefit eval [CONFIG] [--set ...]`: loss and perplexity of a model (random
// init, or model.model_path) on the first --eval_sequences sequences of the
// config's data, in order; with --save_logits OUT --input_ids IN, the logits
// for the "input_ids" tensor of IN (a safetensors file) are written to OUT as
// "logits" (fp32), to compare against another implementation. Collective under
// mpirun: sequences are split over the ranks, experts over the ranks' groups.
#pragma once

#include <memory>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "launch/config.h"
#include "parallel/communicator.h"

namespace moefit::launch {

struct EvalOptions {
  int64_t num_sequences = 64;
  std::string save_logits;  // output file; empty = none
  std::string input_ids;    // input file for save_logits
};

absl::Status RunEval(const RunConfig& run, const EvalOptions& options,
                     std::shared_ptr<parallel::Communicator> world, std::ostream& log);

}  // namespace moefit::launch
