// The start-up check that every rank of a job runs the same program on the
// same inputs.
//
// mpirun starts whatever binary and arguments each host has: an older build
// on one node, a config edited on one host but not on the others, or a model
// directory that differs between hosts' disks all start "fine" and then give
// silently different numbers, or a collective whose shapes do not match and a
// hang. So before any real work every rank contributes a few facts (the
// version, the resolved config, the checkpoint's identity), their SHA-1
// digests are compared, and a difference stops the job with one message that
// names the first rank and the first fact that differ, and the first line in
// which the two ranks' values differ.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "parallel/communicator.h"

namespace moefit::parallel {

struct JobFact {
  // For the message: "moefit version", "resolved config", ...
  std::string name;
  // Compared by digest; sent whole only when it differs. Multi-line values
  // (a config as "path: value" lines) let the message name the line.
  std::string value;
};

// Collective over `world` (every rank passes the same fact names in the same
// order). OK when every rank's values equal rank 0's; otherwise
// FailedPrecondition on every rank: "rank 2 of 4 differs from rank 0 in the
// resolved config: rank 0 has 'train.steps: 2', rank 2 has 'train.steps: 3'".
// So that the job prints it once, rank 0 returns at once and the other ranks
// only after `quiet_wait`, by which time ending the job on rank 0's error has
// normally ended them.
absl::Status CheckSameOnAllRanks(Communicator& world, const std::vector<JobFact>& facts,
                                 absl::Duration quiet_wait = absl::Seconds(10));

struct FactMismatch {
  int rank = 0;
  int fact_idx = 0;
};

// The lowest rank whose digests differ from rank 0's, and the first fact in
// which it does; nullopt when all agree. digests[rank][fact].
std::optional<FactMismatch> FindMismatch(const std::vector<std::vector<std::string>>& digests);

// "rank 0 has 'a: 1', rank 2 has 'a: 2'": the first line in which `reference`
// (rank 0's) and `other` (rank `other_rank`'s) differ.
std::string FirstDifference(const std::string& reference, const std::string& other, int other_rank);

}  // namespace moefit::parallel
