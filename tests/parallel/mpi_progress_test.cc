// The MPI progress thread (parallel/mpi_progress.h), in a binary whose main
// starts one (MOEFIT_TEST_PROGRESS_THREAD_US, mpi_test_main.cc), under
// mpirun -np 2 and 4:
//   * it runs MPI's engine only while a collective of the process is in
//     flight, and sleeps otherwise;
//   * it moves a rank's share of an exchange while that rank makes no MPI call
//     (what lets token exchanges overlap the experts' compute): the peers of
//     a rank that posted an all-to-all of large rows and then busied itself
//     with something else for 400 ms finish theirs long before it looks
//     again. Without the thread they wait the 400 ms: a large message moves
//     only when its receiver's engine runs (rendezvous).
// The rest of this binary is the dispatcher suite, run with the thread on.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "absl/time/clock.h"
#include "tests/parallel/mpi_test_env.h"

namespace moefit::parallel {
namespace {

TEST(MpiProgressThread, PollsOnlyWhileACollectiveIsInFlight) {
  auto world = testing::World();
  MpiProgressThread* thread = testing::ProgressThread();
  ASSERT_NE(thread, nullptr);  // the same on every rank
  const int64_t idle = thread->polls();
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_EQ(thread->polls(), idle) << "polled with nothing in flight";

  // Rank 0 posts an all-reduce that the others join 100 ms later, and waits
  // without calling MPI itself: the thread polls meanwhile.
  if (world->rank() != 0) absl::SleepFor(absl::Milliseconds(100));
  at::Tensor sum = at::full({4}, world->rank() + 1.0, at::kDouble);
  const int64_t before = thread->polls();
  std::shared_ptr<Work> work = world->AllReduce(sum, ReduceOp::kSum);
  if (world->rank() == 0) {
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_GE(thread->polls() - before, 5) << "no polls while the all-reduce was in flight";
  }
  ASSERT_TRUE(work->Wait().ok());
  const double n = world->size();
  EXPECT_DOUBLE_EQ(sum[0].item<double>(), n * (n + 1) / 2);

  // Done: idle again (one poll may have begun as the all-reduce finished).
  const int64_t after = thread->polls();
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_LE(thread->polls() - after, 1);
}

TEST(MpiProgressThread, MovesTheExchangeOfARankThatIsNotCallingMpi) {
  auto world = testing::World();
  // 4 MiB to every peer: far above Open MPI's eager limits.
  constexpr int64_t kRows = 1024, kHidden = 1024;
  const int n = world->size();
  std::vector<int64_t> counts(n, kRows);
  at::Tensor send = at::full({n * kRows, kHidden}, world->rank() + 1.0f);
  at::Tensor recv = at::empty_like(send);
  world->Barrier()->WaitOrThrow();
  std::shared_ptr<Work> work = world->AllToAllV(send, counts, recv, counts);
  const auto start = std::chrono::steady_clock::now();
  if (world->rank() == 0) {
    absl::SleepFor(absl::Milliseconds(400));  // "computing": no MPI call
    ASSERT_TRUE(work->Wait().ok());
  } else {
    ASSERT_TRUE(work->Wait().ok());
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(waited, 0.2) << "rank " << world->rank()
                           << " waited for rank 0 to call MPI again: nothing moved meanwhile";
  }
  for (int q = 0; q < n; ++q) {
    EXPECT_EQ(recv[q * kRows][0].item<float>(), q + 1.0f) << "from rank " << q;
  }
  world->Barrier()->WaitOrThrow();
}

}  // namespace
}  // namespace moefit::parallel
