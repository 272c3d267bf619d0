// The MPI backend under mpirun (-np 2 and 4): every shared collective case
// (collective_cases.h) over CPU tensors, plus what only MPI has: splitting
// long reductions into several calls, the int-count limit, deadlines on Wait,
// and transport errors coming back as a status that names the MPI call. Also
// the parts of the interface that need no peers: the default bodies and the
// foreign-code macro.
#include "parallel/mpi_communicator.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <climits>
#include <thread>

#include "parallel/foreign_check.h"
#include "parallel/internal/collective_checks.h"
#include "parallel/internal/mpi_util.h"
#include "tests/parallel/collective_cases.h"
#include "tests/parallel/mpi_test_env.h"

namespace moefit::parallel {

// A stand-in library for the macro test.
enum class FakeCode { kFine, kBroken };

template <>
struct ForeignCode<FakeCode> {
  static constexpr const char* kLibrary = "Fake";
  static bool Ok(FakeCode code) { return code == FakeCode::kFine; }
  static std::string Describe(FakeCode) { return "the fake library is broken"; }
};

namespace testing {
namespace {

FakeCode FakeCall(FakeCode result) { return result; }

absl::Status CallFake(FakeCode result) {
  MOEFIT_CHECK_FOREIGN(FakeCall(result));
  return absl::OkStatus();
}

TEST(ForeignCheck, FailureNamesLibraryCallAndLocation) {
  EXPECT_TRUE(CallFake(FakeCode::kFine).ok());
  const absl::Status status = CallFake(FakeCode::kBroken);
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(status.message()),
              ::testing::MatchesRegex(
                  "Fake call FakeCall failed at parallel/mpi_communicator_test\\.cc:[0-9]+: "
                  "the fake library is broken"));
}

// A backend that implements nothing: every collective must say so.
class BareCommunicator final : public Communicator {
 public:
  BareCommunicator() : Communicator(0, 1, "bare") {}
  std::string BackendName() const override { return "Bare"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
};

TEST(Communicator, DefaultsFailNamingTheBackend) {
  BareCommunicator comm;
  const at::Tensor tensor = at::zeros({1});
  const std::vector<std::pair<std::string, std::shared_ptr<Work>>> works = {
      {"AllToAllCounts", comm.AllToAllCounts(tensor, tensor)},
      {"AllToAllV", comm.AllToAllV(tensor, {1}, tensor, {1})},
      {"AllReduce", comm.AllReduce(tensor, ReduceOp::kSum)},
      {"AllGather", comm.AllGather(tensor, tensor)},
      {"AllGatherV", comm.AllGatherV(tensor, tensor, {1})},
      {"Broadcast", comm.Broadcast(tensor, 0)},
      {"Barrier", comm.Barrier()},
  };
  for (const auto& [op, work] : works) {
    EXPECT_TRUE(work->IsCompleted()) << op;
    const absl::Status status = work->Wait();
    EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << op;
    EXPECT_NE(status.message().find("Bare backend does not implement " + op), std::string::npos)
        << status;
    EXPECT_THROW(work->WaitOrThrow(), c10::Error) << op;
  }
  const absl::StatusOr<std::shared_ptr<Communicator>> split = comm.Split(0, 0, "");
  EXPECT_EQ(split.status().code(), absl::StatusCode::kUnimplemented);
}

TEST(MpiCounts, IntLimitIsCheckedNotWrapped) {
  const absl::StatusOr<internal::MpiCounts> fits = internal::ToMpiCounts({INT_MAX, 0, 1}, "rows");
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(fits->counts, (std::vector<int>{INT_MAX, 0, 1}));
  EXPECT_EQ(fits->displacements, (std::vector<int>{0, INT_MAX, INT_MAX}));

  const absl::StatusOr<internal::MpiCounts> big_count =
      internal::ToMpiCounts({1, int64_t{INT_MAX} + 1}, "AllToAllV send rows");
  EXPECT_EQ(big_count.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(
      big_count.status().message().find("AllToAllV send rows: count for rank 1 is 2147483648"),
      std::string::npos)
      << big_count.status();

  const absl::StatusOr<internal::MpiCounts> big_offset =
      internal::ToMpiCounts({INT_MAX, 1, 1}, "rows");
  EXPECT_EQ(big_offset.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(big_offset.status().message().find("displacement of rank 2 is 2147483648"),
            std::string::npos)
      << big_offset.status();
}

TEST(MpiCommunicator, Identity) {
  const MpiCommunicator& world = *World();
  int rank = -1;
  int size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(world.rank(), rank);
  EXPECT_EQ(world.size(), size);
  EXPECT_EQ(world.BackendName(), "MPI");
  EXPECT_EQ(world.name(), "world");
  EXPECT_TRUE(world.device().is_cpu());
}

TEST(MpiCommunicator, AllToAllCounts) {
  CheckAllToAllCounts(*World(), 1);
  CheckAllToAllCounts(*World(), 3);
}

TEST(MpiCommunicator, AllToAllV) {
  for (const at::ScalarType dtype : RowDtypes()) {
    for (const std::vector<int64_t>& trailing_shape : TrailingShapes())
      CheckAllToAllV(*World(), dtype, trailing_shape);
  }
}

TEST(MpiCommunicator, AllToAllVGather) {
  for (const at::ScalarType dtype : RowDtypes()) {
    for (const std::vector<int64_t>& trailing_shape : TrailingShapes())
      CheckAllToAllVGather(*World(), dtype, trailing_shape);
  }
}

TEST(MpiCommunicator, AllReduce) {
  for (const at::ScalarType dtype :
       {at::kFloat, at::kBFloat16, at::kHalf, at::kLong, at::kInt, at::kDouble}) {
    for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin})
      CheckAllReduce(*World(), dtype, op);
  }
}

TEST(MpiCommunicator, AllGather) {
  for (const at::ScalarType dtype : RowDtypes()) {
    for (const std::vector<int64_t>& trailing_shape : TrailingShapes())
      CheckAllGather(*World(), dtype, trailing_shape);
  }
}

TEST(MpiCommunicator, AllGatherV) {
  for (const at::ScalarType dtype : RowDtypes()) {
    for (const std::vector<int64_t>& trailing_shape : TrailingShapes()) {
      CheckAllGatherV(*World(), dtype, trailing_shape);
    }
  }
}

TEST(MpiCommunicator, Broadcast) {
  for (const at::ScalarType dtype : RowDtypes()) {
    CheckBroadcast(*World(), dtype, 0);
    CheckBroadcast(*World(), dtype, World()->size() - 1);
  }
}

TEST(MpiCommunicator, Barrier) { CheckBarrier(*World()); }

TEST(MpiCommunicator, OverlappingWork) { CheckOverlappingWork(*World()); }

TEST(MpiCommunicator, Split) { CheckSplit(*World()); }

TEST(MpiCommunicator, LongTensorsTakeSeveralCalls) {
  // 15-element reductions and broadcasts in calls of at most 4 elements.
  absl::StatusOr<std::shared_ptr<MpiCommunicator>> small_calls =
      MpiCommunicator::Create(MPI_COMM_WORLD, {.name = "small-calls", .max_elements_per_call = 4});
  ASSERT_TRUE(small_calls.ok()) << small_calls.status();
  for (const at::ScalarType dtype : RowDtypes()) {
    CheckAllReduce(**small_calls, dtype, ReduceOp::kSum);
    CheckBroadcast(**small_calls, dtype, 1);
  }
}

TEST(MpiCommunicator, ArgumentErrorsThrowBeforePosting) {
  MpiCommunicator& world = *World();
  const std::vector<int64_t> one_per_rank(world.size(), 1);
  const at::Tensor rows = at::zeros({world.size(), 2});
  // One count short.
  EXPECT_THROW(world.AllToAllV(rows, std::vector<int64_t>(world.size() - 1, 1), rows, one_per_rank),
               c10::Error);
  // Counts that do not add up to the rows.
  EXPECT_THROW(world.AllToAllV(rows, std::vector<int64_t>(world.size(), 2), rows, one_per_rank),
               c10::Error);
  // Different row shapes and dtypes.
  EXPECT_THROW(world.AllToAllV(rows, one_per_rank, at::zeros({world.size(), 3}), one_per_rank),
               c10::Error);
  EXPECT_THROW(world.AllGather(rows, at::zeros({world.size() * world.size(), 2}, at::kLong)),
               c10::Error);
  // Not contiguous.
  EXPECT_THROW(world.AllReduce(at::zeros({4, 4}).t(), ReduceOp::kSum), c10::Error);
  EXPECT_THROW(world.Broadcast(rows, world.size()), c10::Error);
  try {
    world.AllToAllCounts(at::zeros({world.size()}), at::zeros({world.size()}));
    ADD_FAILURE() << "fp32 counts were accepted";
  } catch (const c10::Error& error) {
    EXPECT_NE(std::string(error.what()).find("counts must be int64"), std::string::npos)
        << error.what();
  }
}

TEST(MpiCommunicator, WaitWithDeadline) {
  // Rank 0 posts an all-reduce the others join 300 ms later: a 20 ms wait
  // must time out and leave the collective posted, a full wait completes it.
  MpiCommunicator& world = *World();
  const at::Tensor tensor = at::ones({4});
  if (world.rank() != 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const std::shared_ptr<Work> work = world.AllReduce(tensor, ReduceOp::kSum);
  if (world.rank() == 0) {
    const absl::Status early = work->Wait(absl::Milliseconds(20));
    EXPECT_EQ(early.code(), absl::StatusCode::kDeadlineExceeded) << early;
    EXPECT_NE(early.message().find("AllReduce(sum) on communicator 'world' (MPI, rank 0 of"),
              std::string::npos)
        << early;
  }
  EXPECT_TRUE(work->Wait(absl::Seconds(30)).ok());
  EXPECT_TRUE(at::equal(tensor, at::full({4}, world.size(), at::kFloat)));
}

TEST(MpiCommunicator, TransportErrorNamesTheMpiCall) {
  // Rank 1 sends rank 0 two rows where rank 0 expects one: MPI reports the
  // truncation to rank 0 through Wait(), never as a crash.
  MpiCommunicator& world = *World();
  const int num_ranks = world.size();
  std::vector<int64_t> send_rows(num_ranks, 0);
  std::vector<int64_t> recv_rows(num_ranks, 0);
  if (world.rank() == 1) send_rows[0] = 2;
  if (world.rank() == 0) recv_rows[1] = 1;
  const at::Tensor send = at::zeros({internal::Total(send_rows), 3});
  const at::Tensor recv = at::zeros({internal::Total(recv_rows), 3});
  const absl::Status status = world.AllToAllV(send, send_rows, recv, recv_rows)->Wait();
  if (world.rank() == 0) {
    EXPECT_FALSE(status.ok());
    EXPECT_THAT(std::string(status.message()),
                ::testing::ContainsRegex(
                    "AllToAllV on communicator 'world' .*: MPI call MPI_Waitall failed at "
                    "parallel/mpi_communicator\\.cc:[0-9]+: .*"))
        << status;
  }
  // The broken exchange leaves the communicator usable for this test's peers
  // only by luck; give the rest of the suite a clean one.
  EXPECT_TRUE(world.Barrier()->Wait(absl::Seconds(30)).ok());
}

}  // namespace
}  // namespace testing
}  // namespace moefit::parallel
