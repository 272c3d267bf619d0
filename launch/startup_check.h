// What every rank of a `moefit train` or `moefit eval` job must agree on
// before it starts, and the check that they do (parallel/consistency.h).
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "launch/config.h"
#include "parallel/communicator.h"
#include "parallel/consistency.h"

namespace moefit::launch {

// The facts of this rank: the moefit version, the resolved config (one
// "path.to.field: value" line per field, so that a difference names the
// field) and the identity of the checkpoint and adapter it starts from (their
// paths and the digests of their config files, which differ when hosts' disks
// hold different models under the same path).
std::vector<parallel::JobFact> StartupFacts(const RunConfig& run, const std::string& version);

// Collective: StartupFacts on every rank, compared with rank 0's. A mismatch
// is FailedPrecondition (exit code 2) naming the rank and the field. (The
// world size is checked against parallel.ep_size where the process groups
// are made, before anything is loaded.)
absl::Status CheckStartupConsistency(const RunConfig& run, const std::string& version,
                                     parallel::Communicator& world);

// Text format -> "a.b.c: value" lines (exposed for tests).
std::string FlattenTextFormat(const std::string& text);

}  // namespace moefit::launch
