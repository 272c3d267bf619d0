// Where this process is in its work, for the collective watchdog's message.
//
// When a collective does not finish in time, "AllToAllV on 'ep' did not
// finish" is only half a diagnosis: the user also needs to know which step,
// which MoE layer, which phase of it (dispatch or combine, forward or
// backward) and what the last collective that did finish was. Those facts
// belong to the trainer and the model, which know nothing of the watchdog; so
// they write them here, cheaply (relaxed atomics, no allocation), and the
// watchdog reads them when, and only when, it has something to report.
//
// The step also selects the deadline: inside a training step collectives wait
// at most parallel.timeout_s; outside one (start-up, checkpoint loading and
// saving, evaluation) they wait the longer parallel.startup_timeout_s
// (parallel/watchdog.h).
//
// Every setter is meant for the thread that runs the collectives; the readers
// are safe from any thread (the watchdog's own included).
#pragma once

#include <cstdint>
#include <string>

namespace moefit::parallel {

// Marks training step `step` (1-based, as printed) as running for the life of
// the scope: collectives inside it get parallel.timeout_s. Also where the
// test-only fault injection (parallel/fault_injection.h) acts.
class ScopedStep {
 public:
  explicit ScopedStep(int64_t step);
  ~ScopedStep();
  ScopedStep(const ScopedStep&) = delete;
  ScopedStep& operator=(const ScopedStep&) = delete;
};

// Marks decoder layer `layer_idx` as the one whose collectives run now; the
// previous value comes back at the end of the scope. Inside a step, also where
// a test-only fault given a layer acts.
class ScopedLayer {
 public:
  explicit ScopedLayer(int64_t layer_idx);
  ~ScopedLayer();
  ScopedLayer(const ScopedLayer&) = delete;
  ScopedLayer& operator=(const ScopedLayer&) = delete;

 private:
  const int64_t previous_;
};

// Names the phase the next collectives belong to ("dispatch", "combine",
// "gradient all-reduce"); `label` must outlive the scope (a string literal).
class ScopedPhase {
 public:
  explicit ScopedPhase(const char* label, bool backward = false);
  ~ScopedPhase();
  ScopedPhase(const ScopedPhase&) = delete;
  ScopedPhase& operator=(const ScopedPhase&) = delete;

 private:
  const char* const previous_label_;
  const bool previous_backward_;
};

// Marks the end of training step `step`, where the ranks agree on whether to
// stop or save, as still part of the step: its collectives get
// parallel.timeout_s too, and a report names the step and "end of step". A
// rank that finishes its step early waits there for the others; were it
// outside the step, a peer lost at that moment would keep it waiting for
// parallel.startup_timeout_s. A save that follows belongs outside it. No
// test fault acts here (those act where a step or a layer starts).
class ScopedStepEnd {
 public:
  explicit ScopedStepEnd(int64_t step);
  ~ScopedStepEnd();
  ScopedStepEnd(const ScopedStepEnd&) = delete;
  ScopedStepEnd& operator=(const ScopedStepEnd&) = delete;

 private:
  const bool previous_in_step_;
  const ScopedPhase phase_;
};

// Whether a training step is running, and the last one that began (0: none yet).
bool InTrainingStep();
int64_t CurrentStep();
// The layer and phase set by the innermost scopes (-1 / nullptr: none).
int64_t CurrentLayer();
const char* CurrentPhase();
bool CurrentPhaseIsBackward();

// Called by Work::WaitOrThrow when a collective finished: counts it and keeps
// its description as "the last completed collective".
void RecordCompletedCollective(std::string description);

// One line for a failure message: "step 3 (in progress), layer 1, dispatch
// (backward); last completed collective: ... (41 completed)".
std::string DescribeProgress();

}  // namespace moefit::parallel
