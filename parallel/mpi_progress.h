// A thread that keeps MPI's non-blocking collectives moving while this
// process computes.
//
// Open MPI advances a non-blocking collective only inside MPI calls: its
// progress engine runs in whichever thread calls into MPI. A token exchange
// posted before the experts compute (Dispatcher::Run's pipeline, the dense
// gradient buckets posted during backward) therefore moves little more than
// what the transport buffers take until the next MPI call, so it cannot hide
// behind the computation. This thread makes that call: every `interval`,
// while at least one collective of this process is in flight, it runs the
// progress engine (MPI_Iprobe on a communicator of its own, which touches no
// request of the communicators), and it sleeps otherwise.
//
// It needs MPI_THREAD_MULTIPLE (MpiRuntimeOptions::required_thread_level). It
// pays where the link, not the CPU, bounds the exchange (between nodes); where
// the ranks of one node exchange through shared memory on cores they all
// compute on, its wake-ups take time from the computation instead
// (benchmarks/parallel/dispatch_bench measures both).
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace moefit::parallel {

class MpiProgressThread {
 public:
  // Starts the thread (at most one per process). Collective over
  // MPI_COMM_WORLD (it duplicates it). FailedPrecondition if MPI does not run
  // at MPI_THREAD_MULTIPLE; InvalidArgument for an interval that is not
  // positive.
  static absl::StatusOr<std::unique_ptr<MpiProgressThread>> Start(absl::Duration interval);

  // Stops and joins the thread and frees its communicator; before MPI_Finalize.
  ~MpiProgressThread();
  MpiProgressThread(const MpiProgressThread&) = delete;
  MpiProgressThread& operator=(const MpiProgressThread&) = delete;

  // How many times the thread has run the progress engine so far.
  int64_t polls() const { return polls_.load(std::memory_order_relaxed); }

 private:
  MpiProgressThread(MPI_Comm comm, absl::Duration interval);
  void Loop();

  MPI_Comm comm_;
  const absl::Duration interval_;
  std::atomic<int64_t> polls_{0};
  std::thread thread_;
};

namespace internal {

// Called by the MPI communicator's Work when it posts MPI requests and when it
// completes them: the thread runs only while the count is above zero.
void NoteMpiWorkPosted();
void NoteMpiWorkFinished();

}  // namespace internal
}  // namespace moefit::parallel
