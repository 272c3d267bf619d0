// ExpertPlacement: contiguous blocks, uneven counts, rejection of idle ranks.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "router/expert_placement.h"
#include "router/router_parallel.h"

namespace moefit::router {
namespace {

TEST(ExpertPlacement, EvenBlocks) {
  auto p = ExpertPlacement::Contiguous(8, 4);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->owner(0), 0);
  EXPECT_EQ(p->owner(3), 1);
  EXPECT_EQ(p->local_index(3), 1);
  EXPECT_EQ(p->owner(7), 3);
  EXPECT_EQ(p->num_local(2), 2);
  EXPECT_EQ(p->first_expert(2), 4);
}

TEST(ExpertPlacement, UnevenCountsGiveTheFirstRanksOneMore) {
  auto p = ExpertPlacement::Contiguous(10, 4);  // 3, 3, 2, 2
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->num_local(0), 3);
  EXPECT_EQ(p->num_local(1), 3);
  EXPECT_EQ(p->num_local(2), 2);
  EXPECT_EQ(p->num_local(3), 2);
  EXPECT_EQ(p->owner(6), 2);
  EXPECT_EQ(p->local_index(6), 0);
  EXPECT_EQ(p->owner(9), 3);
  EXPECT_EQ(p->local_index(9), 1);
  EXPECT_EQ(p->max_local(), 3);
  int64_t total = 0;
  for (int r = 0; r < 4; ++r) total += p->num_local(r);
  EXPECT_EQ(total, 10);
}

TEST(ExpertPlacement, RejectsRanksWithoutExperts) {
  auto p = ExpertPlacement::Contiguous(2, 4);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().message(),
            "parallel.ep_size = 4 exceeds model.num_experts = 2: some ranks would own no expert");
}

// 5 experts on 2 ranks: rank 0 owns 0-2, rank 1 owns 3-4 (max_local 3).
TEST(RouterParallel, SortsByOwnerThenLocalExpertStably) {
  auto p = ExpertPlacement::Contiguous(5, 2);
  ASSERT_TRUE(p.ok());
  at::Tensor idx = at::tensor({4, 0, 2, 3, 0, 4}, at::kLong).view({3, 2});
  RouterParallel rank0(*p, 0), rank1(*p, 1);
  OwnerOrder o = rank0.SortByOwner(idx);
  // keys: 4 -> 1*3+1 = 4, 0 -> 0, 2 -> 2, 3 -> 3, 0 -> 0, 4 -> 4
  std::vector<int64_t> order(o.order.data_ptr<int64_t>(), o.order.data_ptr<int64_t>() + 6);
  EXPECT_EQ(order, (std::vector<int64_t>{1, 4, 2, 3, 0, 5}));
  EXPECT_TRUE(at::equal(o.counts, at::tensor({2, 0, 1, 1, 2, 0}, at::kLong).view({2, 3})));
  EXPECT_TRUE(at::equal(rank1.SortByOwner(idx).order, o.order));  // the same on every rank
  at::Tensor local1 = rank1.LocalExpertIndex(idx);
  EXPECT_TRUE(at::equal(local1, at::tensor({1, -1, -1, 0, -1, 1}, at::kLong).view({3, 2})));
}

}  // namespace
}  // namespace moefit::router
