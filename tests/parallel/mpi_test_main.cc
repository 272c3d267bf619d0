// GoogleTest main for tests run under mpirun (see mpi_test_env.h).
//
// MPI starts before RUN_ALL_TESTS and finishes after it. Only rank 0 keeps
// gtest's printer, so N ranks do not interleave N copies of the same report;
// other ranks print just their own failures, prefixed with the rank. The
// failure flag is then reduced (max) over the world, so every rank, and thus
// mpirun, exits non-zero when any rank failed. With
// MOEFIT_TEST_PROGRESS_THREAD_US an MPI progress thread runs throughout.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>

#include "parallel/mpi_runtime.h"
#include "tests/parallel/mpi_test_env.h"

namespace moefit::parallel::testing {
namespace {

std::shared_ptr<MpiCommunicator>& WorldSlot() {
  static auto* world = new std::shared_ptr<MpiCommunicator>();
  return *world;
}

std::unique_ptr<MpiProgressThread>& ProgressSlot() {
  static auto* thread = new std::unique_ptr<MpiProgressThread>();
  return *thread;
}

// Failures of a rank other than 0, one line each, with the rank in front.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.message());
  }

  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] [  FAILED  ] %s.%s\n", rank_, info.test_suite_name(),
                   info.name());
    }
  }

 private:
  const int rank_;
};

}  // namespace

const std::shared_ptr<MpiCommunicator>& World() { return WorldSlot(); }

MpiProgressThread* ProgressThread() { return ProgressSlot().get(); }

}  // namespace moefit::parallel::testing

int main(int argc, char** argv) {
  using moefit::parallel::MpiCommunicator;
  using moefit::parallel::MpiRuntime;
#ifdef MOEFIT_TEST_PROGRESS_THREAD_US
  absl::StatusOr<std::unique_ptr<MpiRuntime>> runtime =
      MpiRuntime::Start(&argc, &argv, {.required_thread_level = MPI_THREAD_MULTIPLE});
#else
  absl::StatusOr<std::unique_ptr<MpiRuntime>> runtime = MpiRuntime::Start(&argc, &argv);
#endif
  if (!runtime.ok()) {
    std::fprintf(stderr, "cannot start MPI: %s\n", runtime.status().ToString().c_str());
    return 1;
  }
  ::testing::InitGoogleTest(&argc, argv);
  absl::StatusOr<std::shared_ptr<MpiCommunicator>> world = MpiCommunicator::Create(MPI_COMM_WORLD);
  if (!world.ok()) moefit::parallel::AbortAll(1, world.status().ToString());
  moefit::parallel::testing::WorldSlot() = *world;
#ifdef MOEFIT_TEST_PROGRESS_THREAD_US
  auto progress = moefit::parallel::MpiProgressThread::Start(
      absl::Microseconds(MOEFIT_TEST_PROGRESS_THREAD_US));
  if (!progress.ok()) moefit::parallel::AbortAll(1, progress.status().ToString());
  moefit::parallel::testing::ProgressSlot() = std::move(*progress);
#endif

  const int rank = (*world)->rank();
  if (rank != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new moefit::parallel::testing::RankFailurePrinter(rank));
  }
  const int64_t failed = RUN_ALL_TESTS() != 0 ? 1 : 0;

  // Every rank must agree, or mpirun's exit code depends on which rank failed.
  at::Tensor any_failed = at::full({1}, failed, at::kLong);
  const absl::Status status =
      (*world)->AllReduce(any_failed, moefit::parallel::ReduceOp::kMax)->Wait();
  if (!status.ok()) moefit::parallel::AbortAll(1, status.ToString());
  const bool job_failed = any_failed.item<int64_t>() != 0;
  if (job_failed && rank == 0 && failed == 0)
    std::fprintf(stderr, "rank 0 passed, but another rank failed\n");
  moefit::parallel::testing::ProgressSlot().reset();
  moefit::parallel::testing::WorldSlot().reset();
  runtime->reset();  // MPI_Finalize
  return job_failed ? 1 : 0;
}
