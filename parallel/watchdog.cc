// The collective watchdog; see watchdog.h for why it has two layers.
//
// The background thread polls ten times a second instead of sleeping until
// the nearest deadline: arming and disarming then cost one uncontended mutex
// each (a collective costs far more), and a deadline is reported within
// 100 ms of its grace running out, which the bound of timeout + 15 s
// easily absorbs.
#include "parallel/watchdog.h"

#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "parallel/mpi_runtime.h"
#include "parallel/progress.h"

namespace moefit::parallel {
namespace {

constexpr absl::Duration kPollInterval = absl::Milliseconds(100);

struct Armed {
  int64_t id = 0;
  std::string what;
  absl::Duration timeout;
  absl::Time report_at;  // deadline + grace: when the background thread steps in
  bool reported = false;
};

struct State {
  absl::Mutex mu;
  WatchdogOptions options ABSL_GUARDED_BY(mu);
  std::vector<Armed> armed ABSL_GUARDED_BY(mu);
  int64_t next_id ABSL_GUARDED_BY(mu) = 1;
  bool thread_started ABSL_GUARDED_BY(mu) = false;
};

// Never destroyed: the background thread may read it while the process exits.
State& GetState() {
  static State* state = new State;
  return *state;
}

// Runs on_expire, or AbortAll when there is none.
void Report(const std::function<void(const std::string&)>& on_expire, const std::string& message) {
  if (on_expire) {
    on_expire(message);
    return;
  }
  AbortAll(kWatchdogExitCode, message);
}

[[noreturn]] void BackgroundLoop(State* state) {
  while (true) {
    absl::SleepFor(kPollInterval);
    std::string what;
    absl::Duration timeout;
    std::function<void(const std::string&)> on_expire;
    {
      absl::MutexLock lock(&state->mu);
      const absl::Time now = absl::Now();
      for (Armed& armed : state->armed) {
        if (armed.reported || now < armed.report_at) continue;
        armed.reported = true;
        what = armed.what;
        timeout = armed.timeout;
        on_expire = state->options.on_expire;
        break;
      }
    }
    if (!what.empty()) {
      Report(on_expire, absl::StrCat(WatchdogMessage(what, timeout),
                                     " [reported by the watchdog thread: the waiting thread is "
                                     "blocked and did not come back]"));
    }
  }
}

}  // namespace

void ConfigureWatchdog(WatchdogOptions options) {
  State& state = GetState();
  absl::MutexLock lock(&state.mu);
  state.options = std::move(options);
}

absl::Duration CollectiveTimeout() {
  State& state = GetState();
  absl::MutexLock lock(&state.mu);
  return InTrainingStep() ? state.options.timeout : state.options.startup_timeout;
}

std::string WatchdogMessage(absl::string_view what, absl::Duration timeout) {
  return absl::StrCat(
      "collective watchdog: ", what, " did not finish within ", absl::FormatDuration(timeout), " (",
      InTrainingStep() ? "parallel.timeout_s" : "parallel.startup_timeout_s", "); ",
      DescribeProgress(),
      ". A rank of this communicator is stalled, crashed or cut off from this one (MPI does not "
      "say which): look for the rank whose log stops earliest and check its host and network");
}

WatchdogScope::WatchdogScope(std::string what, absl::Duration timeout)
    : what_(std::move(what)), timeout_(timeout), id_([&] {
        State& state = GetState();
        absl::MutexLock lock(&state.mu);
        const int64_t id = state.next_id++;
        state.armed.push_back(
            {id, what_, timeout_, absl::Now() + timeout_ + state.options.grace, false});
        if (!state.thread_started) {
          state.thread_started = true;
          std::thread(BackgroundLoop, &state).detach();
        }
        return id;
      }()) {}

WatchdogScope::~WatchdogScope() {
  State& state = GetState();
  absl::MutexLock lock(&state.mu);
  for (auto it = state.armed.begin(); it != state.armed.end(); ++it) {
    if (it->id == id_) {
      state.armed.erase(it);
      break;
    }
  }
}

void WatchdogScope::Expire() {
  std::function<void(const std::string&)> on_expire;
  {
    State& state = GetState();
    absl::MutexLock lock(&state.mu);
    for (Armed& armed : state.armed) {
      if (armed.id != id_) continue;
      if (armed.reported) return;  // the background thread was first
      armed.reported = true;
    }
    on_expire = state.options.on_expire;
  }
  Report(on_expire, WatchdogMessage(what_, timeout_));
}

}  // namespace moefit::parallel
