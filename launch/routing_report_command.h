// `moefit routing-report [CONFIG] --data A --data B ... [--set ...]`: which
// experts each data source uses, measured.
//
// For each source (a pre-tokenized JSONL file, one {"input_ids": [...]} per
// line, one sequence each; or a text file through the byte tokenizer, cut
// into sequences of train.seq_len), the model of CONFIG (model.model_path,
// else its seeded random initialization) routes up to --sequences sequences,
// and every MoE layer's choices are counted per sequence. Each expert's share
// of the source's tokens (the fraction of tokens that chose it) gets a
// bootstrap confidence interval from resampling whole sequences
// (router/routing_shares.h). The control is the same tokens shuffled within
// each sequence: what the expert gets from the source's tokens alone,
// without their order.
//
// An expert "takes more of" source A when the lower end of its interval on A
// is above the upper end of its interval on every other source; "beyond the
// tokens" when it is also above the upper end of its interval on A's
// control (the order of A's tokens, not just which tokens they are, draws it
// in). Printed: per source, the experts with the largest lift (share on A
// over the mean of the other sources' shares; over the control with one
// source), with both flags; --json-out FILE writes every layer, expert and
// figure.
//
// Collective under mpirun: the sequences are split over the processes
// (batches of train.micro_batch_size, dealt round-robin), the experts over
// their expert-parallel groups; the per-sequence counts are summed over the
// processes and rank 0 computes and prints the same report as one process.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "launch/config.h"
#include "parallel/communicator.h"

namespace moefit::launch {

struct RoutingReportOptions {
  std::vector<std::string> data;  // one file per source
  int64_t num_sequences = 256;    // per source, at most
  int64_t num_resamples = 1000;
  double confidence = 0.95;
  int64_t top = 5;       // experts listed per source
  std::string json_out;  // every figure, as JSON; empty = none
};

absl::Status RunRoutingReport(const RunConfig& run, const RoutingReportOptions& options,
                              std::shared_ptr<parallel::Communicator> world, std::ostream& log);

// The sequences of one source: JSONL lines' input_ids (each cut to seq_len)
// or a text file's bytes cut into seq_len pieces (a last piece shorter than 2
// tokens dropped); at most max_sequences. Errors name the file (and line).
absl::StatusOr<std::vector<std::vector<int64_t>>> ReadReportSource(const std::string& path,
                                                                   int64_t seq_len,
                                                                   int64_t vocab_size,
                                                                   int64_t max_sequences);

}  // namespace moefit::launch
