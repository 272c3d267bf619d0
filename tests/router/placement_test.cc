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
// Token 1 has both its experts on rank 0: it goes there once, not twice.
TEST(RouterParallel, RoutesEachTokenOncePerOwner) {
  auto p = ExpertPlacement::Contiguous(5, 2);
  ASSERT_TRUE(p.ok());
  at::Tensor idx = at::tensor({4, 0, 2, 0, 0, 4}, at::kLong).view({3, 2});
  RouterParallel rank0(*p, 0), rank1(*p, 1);
  OwnerRoutes r = rank0.RouteByOwner(idx);
  EXPECT_EQ(r.per_owner, (std::vector<int64_t>{3, 2}));
  EXPECT_TRUE(at::equal(r.tokens, at::tensor({0, 1, 2, 0, 2}, at::kLong)));
  EXPECT_TRUE(at::equal(r.local_expert,
                        at::tensor({-1, 0, 2, 0, 0, -1, 1, -1, -1, 1}, at::kLong).view({5, 2})));
  EXPECT_TRUE(at::equal(r.pair_of, at::tensor({0, 3, 1, -1, 2, 4}, at::kLong).view({3, 2})));
  OwnerRoutes r1 = rank1.RouteByOwner(idx);  // the same on every rank
  EXPECT_TRUE(at::equal(r1.tokens, r.tokens));
  EXPECT_TRUE(at::equal(r1.local_expert, r.local_expert));
  at::Tensor local1 = rank1.LocalExpertIndex(idx);
  EXPECT_TRUE(at::equal(local1, at::tensor({1, -1, -1, -1, -1, 1}, at::kLong).view({3, 2})));
}

TEST(RouterParallel, RejectsExpertIdsOutsideTheModel) {
  auto p = ExpertPlacement::Contiguous(5, 2);
  ASSERT_TRUE(p.ok());
  RouterParallel rank0(*p, 0);
  EXPECT_THROW(rank0.RouteByOwner(at::tensor({0, 5}, at::kLong).view({1, 2})), c10::Error);
  EXPECT_THROW(rank0.RouteByOwner(at::tensor({-1, 1}, at::kLong).view({1, 2})), c10::Error);
}

}  // namespace
}  // namespace moefit::router
