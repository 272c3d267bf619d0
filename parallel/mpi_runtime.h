// Process-wide MPI lifetime and the job's emergency exit.
//
// MpiRuntime is the one place MPI is started and finished: the entry point
// holds it for the life of main(), so MPI_Init_thread runs once, before any
// communicator exists, and MPI_Finalize runs once, after main's work is done.
// moefit issues every MPI call from the thread that started MPI, so
// MPI_THREAD_FUNNELED suffices and is what it asks for by default; an MPI
// progress thread (parallel/mpi_progress.h) needs MPI_THREAD_MULTIPLE.
//
// AbortAll is how a rank that cannot go on ends the whole job. A rank that
// simply exits leaves its peers blocked in the next collective until someone
// notices the hang; MPI_Abort makes mpirun kill every rank within seconds and
// exit non-zero. The reason is printed once, with the rank, so a log of many
// ranks still shows why the job died.
#pragma once

#include <mpi.h>

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"

namespace moefit::parallel {

struct MpiRuntimeOptions {
  // Thread support MPI must provide; Start fails if it cannot.
  int required_thread_level = MPI_THREAD_FUNNELED;
  // Route std::terminate (an exception no one caught, on any thread) to
  // AbortAll, so it ends every rank instead of leaving peers in a collective.
  bool abort_on_terminate = true;
};

class MpiRuntime {
 public:
  // Starts MPI (MPI_Init_thread). If MPI is already running (another library
  // started it), the runtime adopts it without taking over finalization; if MPI
  // has already been finalized, it fails: MPI cannot start twice in a process.
  static absl::StatusOr<std::unique_ptr<MpiRuntime>> Start(int* argc, char*** argv,
                                                           const MpiRuntimeOptions& options = {});

  // Finalizes MPI if Start initialized it. Communicators still alive then are
  // left to MPI_Finalize (their destructors see MPI finalized and skip the free).
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  // The thread level MPI provided (>= the required one).
  int thread_level() const { return thread_level_; }

 private:
  MpiRuntime(bool owns_mpi, int world_rank, int world_size, int thread_level);

  const bool owns_mpi_;
  const int world_rank_;
  const int world_size_;
  const int thread_level_;
};

// Ends every rank of the job: prints "moefit: rank r of n aborting the job:
// <reason>" once to stderr, then MPI_Abort(MPI_COMM_WORLD, exit_code); mpirun
// then kills all ranks and exits non-zero. Callable from any thread, a
// watchdog included (MPI_Abort is the one MPI call moefit makes off the MPI
// thread; Open MPI honours it under MPI_THREAD_FUNNELED), and before MPI has
// started or after it has finished (then it exits this process only). Should
// MPI_Abort not end the process within 10 s (this host lost contact with
// mpirun), the process exits by itself with exit_code. A concurrent second
// caller prints nothing. exit_code 0 is replaced by 1: an abort is never a
// success.
[[noreturn]] void AbortAll(int exit_code, std::string_view reason);

}  // namespace moefit::parallel
