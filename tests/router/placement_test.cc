// ExpertPlacement: contiguous blocks, uneven counts, rejection of idle ranks.
#include <gtest/gtest.h>

#include "router/expert_placement.h"

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

}  // namespace
}  // namespace moefit::router
