// The collective watchdog: a collective that does not finish in time ends the
// job with one message that says what it was waiting for, instead of hanging.
//
// Why: a rank whose peer stalled, crashed without MPI noticing, or lost its
// network link waits in its next collective forever, and with it every rank
// of the job; on a rented cluster that is hours of nodes doing nothing, and a
// rank on a host cut off from mpirun outlives the job itself. So every wait
// of Work::WaitOrThrow has a deadline:
//   * parallel.timeout_s inside a training step (parallel/progress.h), where a
//     collective takes milliseconds to seconds;
//   * parallel.startup_timeout_s outside one: start-up, loading and saving
//     checkpoints, evaluation, where one rank may read for many minutes while
//     the others wait.
// When it passes, the waiting rank builds the message (the operation, its
// bytes and communicator, the step, layer and phase, the last collective
// that completed) and hands it to on_expire, by default AbortAll, which ends
// every rank through MPI_Abort and, should that not return or reach mpirun,
// exits this process by itself (parallel/mpi_runtime.h).
//
// Two layers, because a thread blocked inside MPI cannot notice anything:
//   1. the waiting thread polls its collective (MPI_Testall) and reports the
//      deadline itself: the ordinary path, every MPI call on the MPI thread;
//   2. a background thread is armed around every wait and every blocking MPI
//      call (WatchdogScope); if the waiter has not come back `grace` after
//      its deadline, the background thread reports and aborts in its place.
//      MPI is started MPI_THREAD_FUNNELED, so this MPI_Abort off the MPI
//      thread is outside what the standard promises: Open MPI honours it, and
//      the exit that follows it covers an MPI that does not.
// Without ConfigureWatchdog the defaults below apply, so even a tool or test
// that never reads a config cannot hang for ever.
#pragma once

#include <functional>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace moefit::parallel {

// Exit code of a job the watchdog ended (as timeout(1)'s), so that scripts
// can tell a hang from a crash or a bad config.
inline constexpr int kWatchdogExitCode = 124;

struct WatchdogOptions {
  // Deadline of a collective inside a training step (parallel.timeout_s).
  absl::Duration timeout = absl::Seconds(300);
  // Deadline outside a step (parallel.startup_timeout_s).
  absl::Duration startup_timeout = absl::Seconds(1800);
  // How long after a deadline the background thread waits for the waiting
  // thread to report it before it reports it itself.
  absl::Duration grace = absl::Seconds(2);
  // What a passed deadline does with the message; empty = AbortAll with
  // kWatchdogExitCode. Tests replace it; if it returns, the waiting thread
  // throws c10::Error with the message.
  std::function<void(const std::string& message)> on_expire;
};

// Process-wide; call before the first collective (moefit does, from the
// config). Not meant to change while collectives are waiting.
void ConfigureWatchdog(WatchdogOptions options);

// The deadline a wait that starts now gets: timeout inside a training step,
// startup_timeout outside one.
absl::Duration CollectiveTimeout();

// Arms the background thread for one blocking operation: if the scope is still
// open `timeout` + grace from now, the operation is reported as not finished
// (with `what` and the progress) and on_expire runs. Scopes nest; the inner
// one is watched while it is open.
class WatchdogScope {
 public:
  explicit WatchdogScope(std::string what, absl::Duration timeout = CollectiveTimeout());
  ~WatchdogScope();
  WatchdogScope(const WatchdogScope&) = delete;
  WatchdogScope& operator=(const WatchdogScope&) = delete;

  // The waiting thread saw the deadline pass itself: reports now (on_expire).
  // Returns only if on_expire does.
  void Expire();

 private:
  const std::string what_;
  const absl::Duration timeout_;
  const int64_t id_;
};

// The watchdog's message for `what` not finishing within `timeout`.
std::string WatchdogMessage(absl::string_view what, absl::Duration timeout);

}  // namespace moefit::parallel
