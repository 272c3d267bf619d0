// Test-only fault injection: makes one rank of a job stall, crash or run slow
// at a chosen training step, so that tests can show that the job then ends (or
// survives) the way it must. Never used by a normal run: it acts only when the
// MOEFIT_FAULT environment variable is set, and moefit only reads it when it
// starts a command.
//
//   MOEFIT_FAULT=stall:rank=1:step=3   world rank 1 stops for ever at the start
//                                      of step 3, outside MPI (a hung rank);
//   MOEFIT_FAULT=crash:rank=1:step=3   world rank 1 is killed (SIGKILL) at the
//                                      start of step 3 (a lost node);
//   MOEFIT_FAULT=slow:rank=1:ms=2000   world rank 1 sleeps 2000 ms at the start
//                                      of every step (or only step N with
//                                      :step=N): a slow but live rank.
// With :layer=L, the fault acts instead where the MoE layer L of that step
// starts its collectives (ScopedLayer; again in its backward, for slow), so
// that the peers are left waiting inside that layer's token dispatch. With
// :at=save, it acts inside the save of the training checkpoint after step S
// (after every save, for slow without a step), once this rank has written its
// first file of weights and before it reports its files: a slow rank there
// (slow:rank=1:ms=3000:step=4:at=save) holds the save open long enough for a
// test to cut its host's link while the new checkpoint is half written.
// Keys may come in any order; each is required once where shown, nothing else
// is accepted, and a spec that does not parse is an error, never ignored.
// The rank prints one line when a fault acts, with the Unix time, so a test
// can measure how long the job took to end after it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moefit::parallel {

struct FaultSpec {
  enum class Kind { kStall, kCrash, kSlow };
  Kind kind = Kind::kStall;
  int rank = 0;
  int64_t step = 0;      // 1-based; 0 = every step (slow only)
  int64_t ms = 0;        // slow only
  int64_t layer = -1;    // decoder layer; -1 = at the start of the step
  bool in_save = false;  // in the checkpoint save after `step` instead
};

// Parses one spec (the grammar above); InvalidArgument names what is wrong.
absl::StatusOr<FaultSpec> ParseFaultSpec(absl::string_view spec);

// Reads MOEFIT_FAULT (unset or empty: no fault) and arms it if it names
// `world_rank`. InvalidArgument, naming the variable, if it does not parse.
absl::Status InstallFaultFromEnvironment(int world_rank);

// Applies the armed fault if it is due at `step` and `layer` (called by
// ScopedStep with layer -1, and by ScopedLayer inside a step).
void MaybeInjectFault(int64_t step, int64_t layer = -1);

// Applies the armed :at=save fault if it is due in the save of the training
// checkpoint after `steps_done` steps (called there, once per save, after
// this rank's first file).
void MaybeInjectFaultInSave(int64_t steps_done);

}  // namespace moefit::parallel
