// A rank blocked inside a blocking MPI call, where it cannot notice any
// deadline itself: the watchdog's background thread must end the job.
//
// Rank 1 sleeps outside MPI; rank 0 enters MPI_Barrier (blocking, not a Work
// it could poll) under a WatchdogScope of 2 s. With a grace of 1 s the
// background thread reports and calls MPI_Abort from off the MPI thread,
// which must end both ranks with exit code 124 well before rank 1 wakes up.
// Run under mpirun by parallel_watchdog_blocked_in_mpi_np2 through
// expect_abort.cmake.
#include <mpi.h>

#include <cstdio>

#include "absl/time/clock.h"
#include "parallel/mpi_runtime.h"
#include "parallel/watchdog.h"

int main(int argc, char** argv) {
  using namespace moefit::parallel;
  absl::StatusOr<std::unique_ptr<MpiRuntime>> runtime = MpiRuntime::Start(&argc, &argv);
  if (!runtime.ok()) AbortAll(1, runtime.status().ToString());
  WatchdogOptions options;
  options.grace = absl::Seconds(1);
  ConfigureWatchdog(options);
  if ((*runtime)->world_rank() == 1) {
    absl::SleepFor(absl::Seconds(60));
  } else {
    WatchdogScope watch("MPI_Barrier on MPI_COMM_WORLD (blocking)", absl::Seconds(2));
    MPI_Barrier(MPI_COMM_WORLD);
  }
  std::fprintf(stderr, "watchdog_demo: rank %d got past the barrier, which it never should\n",
               (*runtime)->world_rank());
  return 0;
}
