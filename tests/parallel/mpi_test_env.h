// What mpi_test_main.cc provides to multi-rank tests: the world communicator.
//
// Multi-rank tests are ordinary GoogleTest binaries that ctest starts under
// `mpirun -np N`; mpi_test_main.cc starts MPI before RUN_ALL_TESTS, prints
// gtest output from rank 0 (other ranks print only their failures, prefixed
// with the rank) and makes every rank exit non-zero if any rank failed.
// Tests must not return early (ASSERT_*) between collectives on only some
// ranks: the others would wait for them until the ctest timeout. Where a step
// can fail on some ranks only (a save, a load), agree on the outcome first
// (framework::AnyRankFailed), so that every rank goes on or every rank stops.
//
// Built with MOEFIT_TEST_PROGRESS_THREAD_US=N, the main starts MPI at
// MPI_THREAD_MULTIPLE with an MPI progress thread polling every N us
// (parallel/mpi_progress.h), so that the same tests run with one.
#pragma once

#include <memory>

#include "parallel/mpi_communicator.h"
#include "parallel/mpi_progress.h"

namespace moefit::parallel::testing {

// MPI_COMM_WORLD as an MpiCommunicator named "world", alive for the whole run.
const std::shared_ptr<MpiCommunicator>& World();

// The progress thread, or nullptr when built without one.
MpiProgressThread* ProgressThread();

}  // namespace moefit::parallel::testing
