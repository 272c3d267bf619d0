// Process groups under mpirun (-np 2 and 4): the membership of the expert-
// parallel, expert-data-parallel and data-parallel groups, learned by gathering
// world ranks over each group and compared with the layout the header
// promises; for world 4 and ep_size 2 also with the literal table.
#include "parallel/process_groups.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "tests/parallel/mpi_test_env.h"

namespace moefit::parallel::testing {
namespace {

// The world ranks of `group`, in group rank order.
std::vector<int64_t> Members(Communicator& group, int world_rank) {
  const at::Tensor gathered = at::full({group.size()}, -1, at::kLong);
  const absl::Status status =
      group.AllGather(at::full({1}, world_rank, at::kLong), gathered)->Wait();
  EXPECT_TRUE(status.ok()) << status;
  return std::vector<int64_t>(gathered.data_ptr<int64_t>(),
                              gathered.data_ptr<int64_t>() + gathered.numel());
}

ProcessGroups MakeOrDie(int ep_size) {
  absl::StatusOr<ProcessGroups> groups = MakeProcessGroups(World(), {.ep_size = ep_size});
  EXPECT_TRUE(groups.ok()) << groups.status();
  return groups.ok() ? *std::move(groups) : ProcessGroups{};
}

TEST(ProcessGroups, EveryValidEpSizeMatchesTheLayout) {
  const int world_size = World()->size();
  const int rank = World()->rank();
  for (int ep_size = 1; ep_size <= world_size; ++ep_size) {
    if (world_size % ep_size != 0) continue;
    SCOPED_TRACE(::testing::Message() << "ep_size " << ep_size);
    ProcessGroups groups = MakeOrDie(ep_size);
    ASSERT_NE(groups.expert_parallel, nullptr);  // the same on every rank
    ASSERT_NE(groups.expert_data_parallel, nullptr);
    EXPECT_EQ(groups.ep_size, ep_size);
    EXPECT_EQ(groups.ep_group_idx, rank / ep_size);
    EXPECT_EQ(groups.world.get(), World().get());
    EXPECT_EQ(groups.data_parallel.get(), World().get());

    std::vector<int64_t> expected_ep;  // consecutive ranks
    for (int member = rank / ep_size * ep_size; member < (rank / ep_size + 1) * ep_size; ++member) {
      expected_ep.push_back(member);
    }
    std::vector<int64_t> expected_edp;  // same position in every EP group
    for (int member = rank % ep_size; member < world_size; member += ep_size)
      expected_edp.push_back(member);

    EXPECT_EQ(groups.expert_parallel->name(), "ep");
    EXPECT_EQ(groups.expert_parallel->size(), ep_size);
    EXPECT_EQ(groups.expert_parallel->rank(), rank % ep_size);
    EXPECT_EQ(Members(*groups.expert_parallel, rank), expected_ep);
    EXPECT_EQ(groups.expert_data_parallel->name(), "edp");
    EXPECT_EQ(groups.expert_data_parallel->size(), world_size / ep_size);
    EXPECT_EQ(groups.expert_data_parallel->rank(), groups.ep_group_idx);
    EXPECT_EQ(Members(*groups.expert_data_parallel, rank), expected_edp);
  }
}

TEST(ProcessGroups, WorldFourEpTwo) {
  if (World()->size() != 4) GTEST_SKIP() << "needs exactly 4 ranks";
  const int rank = World()->rank();
  ProcessGroups groups = MakeOrDie(2);
  ASSERT_NE(groups.expert_parallel, nullptr);
  ASSERT_NE(groups.expert_data_parallel, nullptr);
  const std::vector<std::vector<int64_t>> ep_of_rank = {{0, 1}, {0, 1}, {2, 3}, {2, 3}};
  const std::vector<std::vector<int64_t>> edp_of_rank = {{0, 2}, {1, 3}, {0, 2}, {1, 3}};
  EXPECT_EQ(Members(*groups.expert_parallel, rank), ep_of_rank[rank]);
  EXPECT_EQ(Members(*groups.expert_data_parallel, rank), edp_of_rank[rank]);
  EXPECT_EQ(Members(*groups.data_parallel, rank), (std::vector<int64_t>{0, 1, 2, 3}));

  // Gradients of replicated experts: sum over replicas only.
  const at::Tensor grad = at::full({2}, rank, at::kFloat);
  EXPECT_TRUE(groups.expert_data_parallel->AllReduce(grad, ReduceOp::kSum)->Wait().ok());
  EXPECT_TRUE(at::equal(grad, at::full({2}, rank % 2 == 0 ? 0 + 2 : 1 + 3, at::kFloat))) << grad;
}

TEST(ProcessGroups, WholeWorldByDefault) {
  ProcessGroups groups = MakeOrDie(0);
  ASSERT_NE(groups.expert_parallel, nullptr);
  EXPECT_EQ(groups.ep_size, World()->size());
  EXPECT_EQ(groups.expert_parallel->size(), World()->size());
  EXPECT_EQ(groups.expert_data_parallel->size(), 1);
}

TEST(ProcessGroups, BadEpSizeIsAClearError) {
  const int world_size = World()->size();
  const absl::StatusOr<ProcessGroups> too_big =
      MakeProcessGroups(World(), {.ep_size = world_size + 1});
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kInvalidArgument);
  const absl::StatusOr<ProcessGroups> negative = MakeProcessGroups(World(), {.ep_size = -2});
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  if (world_size == 4) {
    const absl::StatusOr<ProcessGroups> uneven = MakeProcessGroups(World(), {.ep_size = 3});
    EXPECT_EQ(uneven.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(uneven.status().message().find("world size 4 is not divisible by ep_size 3"),
              std::string::npos)
        << uneven.status();
  }
  EXPECT_EQ(MakeProcessGroups(nullptr, {.ep_size = 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moefit::parallel::testing
