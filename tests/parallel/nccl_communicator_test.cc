// The NCCL backend under mpirun (-np 1 and 2): the same collective cases as
// the MPI backend (collective_cases.h), over CUDA tensors, bootstrapped over
// the MPI world. Rank r uses GPU r % device count; NCCL allows one rank per
// GPU, so every test skips (GTEST_SKIP) without CUDA or with fewer GPUs than
// ranks. Built only when CMake found NCCL.
#include "parallel/nccl_communicator.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <memory>

#include "tests/parallel/collective_cases.h"
#include "tests/parallel/mpi_test_env.h"

namespace moefit::parallel::testing {
namespace {

class NcclCommunicatorTest : public ::testing::Test {
 protected:
  // Every rank reaches the same verdict: all see the same machine.
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
    if (static_cast<int>(torch::cuda::device_count()) < World()->size()) {
      GTEST_SKIP() << "NCCL needs one GPU per rank: " << torch::cuda::device_count() << " GPUs for "
                   << World()->size() << " ranks";
    }
    const int device_idx = World()->rank() % static_cast<int>(torch::cuda::device_count());
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(device_idx));
    absl::StatusOr<std::shared_ptr<NcclCommunicator>> comm =
        NcclCommunicator::Create(World(), {.name = "world", .device_idx = device_idx});
    ASSERT_TRUE(comm.ok()) << comm.status();
    comm_ = *std::move(comm);
  }

  std::shared_ptr<NcclCommunicator> comm_;
};

TEST_F(NcclCommunicatorTest, Identity) {
  EXPECT_EQ(comm_->rank(), World()->rank());
  EXPECT_EQ(comm_->size(), World()->size());
  EXPECT_EQ(comm_->BackendName(), "NCCL");
  EXPECT_TRUE(comm_->device().is_cuda());
}

TEST_F(NcclCommunicatorTest, AllToAllCounts) {
  CheckAllToAllCounts(*comm_, 1);
  CheckAllToAllCounts(*comm_, 3);
}

TEST_F(NcclCommunicatorTest, AllToAllV) {
  for (const at::ScalarType dtype : RowDtypes()) {
    for (const std::vector<int64_t>& trailing_shape : TrailingShapes())
      CheckAllToAllV(*comm_, dtype, trailing_shape);
  }
}

TEST_F(NcclCommunicatorTest, AllToAllVGather) {
  for (const at::ScalarType dtype : RowDtypes()) {
    for (const std::vector<int64_t>& trailing_shape : TrailingShapes())
      CheckAllToAllVGather(*comm_, dtype, trailing_shape);
  }
}

TEST_F(NcclCommunicatorTest, AllReduce) {
  for (const at::ScalarType dtype :
       {at::kFloat, at::kBFloat16, at::kHalf, at::kLong, at::kInt, at::kDouble}) {
    for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin})
      CheckAllReduce(*comm_, dtype, op);
  }
}

TEST_F(NcclCommunicatorTest, AllGather) {
  for (const at::ScalarType dtype : RowDtypes()) {
    for (const std::vector<int64_t>& trailing_shape : TrailingShapes())
      CheckAllGather(*comm_, dtype, trailing_shape);
  }
}

TEST_F(NcclCommunicatorTest, AllGatherV) {
  for (const at::ScalarType dtype : RowDtypes()) {
    for (const std::vector<int64_t>& trailing_shape : TrailingShapes())
      CheckAllGatherV(*comm_, dtype, trailing_shape);
  }
}

TEST_F(NcclCommunicatorTest, Broadcast) {
  for (const at::ScalarType dtype : RowDtypes()) {
    CheckBroadcast(*comm_, dtype, 0);
    CheckBroadcast(*comm_, dtype, comm_->size() - 1);
  }
}

TEST_F(NcclCommunicatorTest, Barrier) { CheckBarrier(*comm_); }

TEST_F(NcclCommunicatorTest, OverlappingWork) { CheckOverlappingWork(*comm_); }

TEST_F(NcclCommunicatorTest, Split) { CheckSplit(*comm_); }

TEST_F(NcclCommunicatorTest, HostTensorsAreRefused) {
  EXPECT_THROW(comm_->AllReduce(at::ones({2}), ReduceOp::kSum), c10::Error);
}

}  // namespace
}  // namespace moefit::parallel::testing
