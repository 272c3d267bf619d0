// The progress registry; see progress.h. Plain process-wide atomics: the
// writers are the one thread that runs collectives, the reader (the watchdog)
// only needs a recent view, so relaxed ordering is enough; the last completed
// collective's text is the one field behind a mutex.
#include "parallel/progress.h"

#include <atomic>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "parallel/fault_injection.h"

namespace moefit::parallel {
namespace {

std::atomic<int64_t> current_step{0};
std::atomic<bool> in_step{false};
std::atomic<int64_t> current_layer{-1};
std::atomic<const char*> current_phase{nullptr};
std::atomic<bool> phase_backward{false};
std::atomic<int64_t> num_completed{0};

struct LastCompleted {
  absl::Mutex mu;
  std::string description ABSL_GUARDED_BY(mu);
};

LastCompleted& Last() {
  static LastCompleted* last = new LastCompleted;  // never destroyed: read at any time
  return *last;
}

}  // namespace

ScopedStep::ScopedStep(int64_t step) {
  current_step.store(step, std::memory_order_relaxed);
  in_step.store(true, std::memory_order_relaxed);
  MaybeInjectFault(step);
}

ScopedStep::~ScopedStep() { in_step.store(false, std::memory_order_relaxed); }

ScopedStepEnd::ScopedStepEnd(int64_t step)
    : previous_in_step_(in_step.exchange(true, std::memory_order_relaxed)),
      phase_("end of step (agreeing whether to stop or save)") {
  current_step.store(step, std::memory_order_relaxed);
}

ScopedStepEnd::~ScopedStepEnd() { in_step.store(previous_in_step_, std::memory_order_relaxed); }

ScopedLayer::ScopedLayer(int64_t layer_idx)
    : previous_(current_layer.exchange(layer_idx, std::memory_order_relaxed)) {
  if (InTrainingStep()) MaybeInjectFault(CurrentStep(), layer_idx);
}

ScopedLayer::~ScopedLayer() { current_layer.store(previous_, std::memory_order_relaxed); }

ScopedPhase::ScopedPhase(const char* label, bool backward)
    : previous_label_(current_phase.exchange(label, std::memory_order_relaxed)),
      previous_backward_(phase_backward.exchange(backward, std::memory_order_relaxed)) {}

ScopedPhase::~ScopedPhase() {
  current_phase.store(previous_label_, std::memory_order_relaxed);
  phase_backward.store(previous_backward_, std::memory_order_relaxed);
}

bool InTrainingStep() { return in_step.load(std::memory_order_relaxed); }
int64_t CurrentStep() { return current_step.load(std::memory_order_relaxed); }
int64_t CurrentLayer() { return current_layer.load(std::memory_order_relaxed); }
const char* CurrentPhase() { return current_phase.load(std::memory_order_relaxed); }
bool CurrentPhaseIsBackward() { return phase_backward.load(std::memory_order_relaxed); }

void RecordCompletedCollective(std::string description) {
  num_completed.fetch_add(1, std::memory_order_relaxed);
  LastCompleted& last = Last();
  absl::MutexLock lock(&last.mu);
  last.description = std::move(description);
}

std::string DescribeProgress() {
  std::string out;
  const int64_t step = CurrentStep();
  if (InTrainingStep()) {
    absl::StrAppend(&out, "in training step ", step);
  } else if (step > 0) {
    absl::StrAppend(&out, "outside training steps (last step begun: ", step, ")");
  } else {
    absl::StrAppend(&out, "before the first training step");
  }
  if (const int64_t layer = CurrentLayer(); layer >= 0) absl::StrAppend(&out, ", layer ", layer);
  if (const char* phase = CurrentPhase(); phase != nullptr) {
    absl::StrAppend(&out, ", ", phase, CurrentPhaseIsBackward() ? " (backward)" : "");
  }
  const int64_t completed = num_completed.load(std::memory_order_relaxed);
  LastCompleted& last = Last();
  absl::MutexLock lock(&last.mu);
  if (completed == 0) {
    absl::StrAppend(&out, "; no collective has completed yet");
  } else {
    absl::StrAppend(&out, "; last completed collective: ", last.description, " (", completed,
                    " completed)");
  }
  return out;
}

}  // namespace moefit::parallel
