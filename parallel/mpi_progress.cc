// The MPI progress thread; see mpi_progress.h.
#include "parallel/mpi_progress.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "parallel/internal/mpi_util.h"

namespace moefit::parallel {
namespace {

// What the thread waits on: collectives in flight, and whether to stop.
struct Shared {
  absl::Mutex mu;
  int64_t in_flight ABSL_GUARDED_BY(mu) = 0;
  bool running ABSL_GUARDED_BY(mu) = false;  // a thread exists
  bool stop ABSL_GUARDED_BY(mu) = false;
};

Shared& State() {
  static Shared* const state = new Shared;
  return *state;
}

}  // namespace

namespace internal {

void NoteMpiWorkPosted() {
  Shared& s = State();
  absl::MutexLock lock(&s.mu);
  ++s.in_flight;
}

void NoteMpiWorkFinished() {
  Shared& s = State();
  absl::MutexLock lock(&s.mu);
  --s.in_flight;
}

}  // namespace internal

absl::StatusOr<std::unique_ptr<MpiProgressThread>> MpiProgressThread::Start(
    absl::Duration interval) {
  if (interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the MPI progress thread's interval must be positive, not ",
                     absl::FormatDuration(interval)));
  }
  int level = 0;
  MOEFIT_CHECK_FOREIGN(MPI_Query_thread(&level));
  if (level < MPI_THREAD_MULTIPLE) {
    return absl::FailedPreconditionError(
        "an MPI progress thread needs MPI_THREAD_MULTIPLE, which MPI was not started with");
  }
  Shared& s = State();
  {
    absl::MutexLock lock(&s.mu);
    if (s.running)
      return absl::FailedPreconditionError("an MPI progress thread is already running");
  }
  MPI_Comm comm = MPI_COMM_NULL;
  MOEFIT_CHECK_FOREIGN(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
  MOEFIT_CHECK_FOREIGN(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
  {
    absl::MutexLock lock(&s.mu);
    s.running = true;
    s.stop = false;
  }
  return std::unique_ptr<MpiProgressThread>(new MpiProgressThread(comm, interval));
}

MpiProgressThread::MpiProgressThread(MPI_Comm comm, absl::Duration interval)
    : comm_(comm), interval_(interval), thread_([this] { Loop(); }) {}

MpiProgressThread::~MpiProgressThread() {
  Shared& s = State();
  {
    absl::MutexLock lock(&s.mu);
    s.stop = true;
  }
  thread_.join();
  {
    absl::MutexLock lock(&s.mu);
    s.running = false;
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&comm_);
}

void MpiProgressThread::Loop() {
  Shared& s = State();
  while (true) {
    {
      absl::MutexLock lock(&s.mu);
      s.mu.Await(absl::Condition(
          +[](Shared* st)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(st->mu) { return st->stop || st->in_flight > 0; },
          &s));
      if (s.stop) return;
    }
    // Runs the progress engine; nothing is ever sent on comm_, and an error
    // here is left to the waiting thread, whose collective reports it.
    int flag = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, MPI_STATUS_IGNORE);
    polls_.fetch_add(1, std::memory_order_relaxed);
    absl::SleepFor(interval_);
  }
}

}  // namespace moefit::parallel
