// The GPU each process takes: the pure choice from (node rank, GPU count)
// with fake counts, and the node-local rank from MPI under mpirun (all ranks
// of a test job share this one machine, so each one's node rank is its world
// rank).
#include "parallel/node_devices.h"

#include <gtest/gtest.h>

#include <vector>

#include "tests/parallel/mpi_test_env.h"

namespace moefit::parallel::testing {
namespace {

std::vector<int> Choices(int local_size, int num_gpus, int ranks_per_gpu) {
  std::vector<int> out;
  for (int r = 0; r < local_size; ++r) {
    absl::StatusOr<int> gpu = ChooseGpu({r, local_size}, num_gpus, {ranks_per_gpu});
    EXPECT_TRUE(gpu.ok()) << gpu.status();
    out.push_back(gpu.ok() ? *gpu : -1);
  }
  return out;
}

TEST(ChooseGpu, OneGpuPerProcessWhenThereAreEnough) {
  EXPECT_EQ(Choices(1, 1, 1), (std::vector<int>{0}));
  EXPECT_EQ(Choices(4, 4, 1), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(Choices(2, 8, 1), (std::vector<int>{0, 1}));
  EXPECT_EQ(Choices(2, 8, 4), (std::vector<int>{0, 1}));  // sharing allowed, not needed
  EXPECT_TRUE(GpuPerProcess({0, 4}, 4));
  EXPECT_TRUE(GpuPerProcess({0, 2}, 8));
}

TEST(ChooseGpu, SharedGpusWhenAllowed) {
  EXPECT_EQ(Choices(2, 1, 2), (std::vector<int>{0, 0}));
  EXPECT_EQ(Choices(4, 2, 2), (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(Choices(3, 2, 2), (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(Choices(8, 2, 8), (std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_FALSE(GpuPerProcess({0, 2}, 1));
  EXPECT_FALSE(GpuPerProcess({0, 4}, 2));
}

TEST(ChooseGpu, MoreProcessesThanAllowedNamesBothCounts) {
  absl::StatusOr<int> gpu = ChooseGpu({0, 2}, 1, {});
  ASSERT_FALSE(gpu.ok());
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu.status().message(),
            "2 processes run on this node but it has 1 GPU for at most 1 process each "
            "(parallel.ranks_per_gpu); start at most 1 processes per node, set "
            "parallel.ranks_per_gpu to 2 to share the GPUs, or parallel.device = cpu");
  gpu = ChooseGpu({5, 9}, 2, {4});
  ASSERT_FALSE(gpu.ok());
  EXPECT_NE(gpu.status().message().find("9 processes run on this node but it has 2 GPUs"),
            std::string::npos)
      << gpu.status();
  EXPECT_NE(gpu.status().message().find("set parallel.ranks_per_gpu to 5"), std::string::npos);
}

TEST(ChooseGpu, NoGpuOrBadSharingIsAnError) {
  EXPECT_EQ(ChooseGpu({0, 1}, 0).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ChooseGpu({0, 1}, 1, {0}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FindNodeRank, IsTheWorldRankOnOneMachine) {
  absl::StatusOr<NodeRank> node = FindNodeRank(*World());
  ASSERT_TRUE(node.ok()) << node.status();
  EXPECT_EQ(node->local_rank, World()->rank());
  EXPECT_EQ(node->local_size, World()->size());
}

}  // namespace
}  // namespace moefit::parallel::testing
