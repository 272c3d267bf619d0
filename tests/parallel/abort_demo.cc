// A job that fails on purpose, to show that one rank's failure ends every rank
// quickly instead of leaving the others blocked in a collective.
//
// Every rank runs "training steps" of one all-reduce each; at step 3, rank 1
// throws while the other ranks are already waiting in that step's all-reduce.
//   abort_demo              the exception is caught at the top, as moefit's
//                           entry points do, and handed to AbortAll;
//   abort_demo --uncaught   nothing catches it: std::terminate, which
//                           MpiRuntime routes to AbortAll.
// Run under mpirun by the ctest tests parallel_abort_on_failure_* through
// expect_abort.cmake, which require a non-zero exit well within 30 s and the
// reason printed exactly once.
#include <ATen/ATen.h>

#include <cstdio>
#include <stdexcept>
#include <string_view>

#include "parallel/mpi_communicator.h"
#include "parallel/mpi_runtime.h"

namespace {

constexpr int kFailingRank = 1;
constexpr int kFailingStep = 3;
constexpr int kNumSteps = 1000;
constexpr int kExitCode = 3;

void Train(moefit::parallel::Communicator& world) {
  for (int step_idx = 0; step_idx < kNumSteps; ++step_idx) {
    if (world.rank() == kFailingRank && step_idx == kFailingStep) {
      throw std::runtime_error("injected failure at step 3");
    }
    const at::Tensor loss = at::ones({4});
    world.AllReduce(loss, moefit::parallel::ReduceOp::kSum)->WaitOrThrow();
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::StatusOr<std::unique_ptr<moefit::parallel::MpiRuntime>> runtime =
      moefit::parallel::MpiRuntime::Start(&argc, &argv);
  if (!runtime.ok()) moefit::parallel::AbortAll(kExitCode, runtime.status().ToString());
  absl::StatusOr<std::shared_ptr<moefit::parallel::MpiCommunicator>> world =
      moefit::parallel::MpiCommunicator::Create(MPI_COMM_WORLD);
  if (!world.ok()) moefit::parallel::AbortAll(kExitCode, world.status().ToString());

  if (argc > 1 && std::string_view(argv[1]) == "--uncaught") {
    Train(**world);
  } else {
    try {
      Train(**world);
    } catch (const std::exception& error) {
      moefit::parallel::AbortAll(kExitCode, error.what());
    }
  }
  std::fprintf(stderr, "abort_demo: rank %d finished all steps, which it never should\n",
               (*world)->rank());
  return 0;
}
