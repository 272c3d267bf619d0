// NaturalLess: digit runs by value, everything else by byte, and a strict total
// order (checked exhaustively on a small alphabet) so it is safe for std::sort.
#include "checkpoint/natural_order.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

namespace moefit::checkpoint {
namespace {

TEST(NaturalOrderTest, DigitRunsCompareByValue) {
  EXPECT_TRUE(NaturalLess("experts.9", "experts.10"));
  EXPECT_FALSE(NaturalLess("experts.10", "experts.9"));
  EXPECT_TRUE(NaturalLess("layers.2.mlp", "layers.10.attn"));
  EXPECT_TRUE(NaturalLess("a", "a0"));
  EXPECT_TRUE(NaturalLess("a9b", "a10a"));
  EXPECT_TRUE(NaturalLess("x99999999999999999999999", "x100000000000000000000000"));
  EXPECT_FALSE(NaturalLess("same.1", "same.1"));
}

TEST(NaturalOrderTest, LeadingZerosTieBreakByBytes) {
  EXPECT_TRUE(NaturalLess("e.01", "e.1"));  // "0" < "1" in byte order
  EXPECT_FALSE(NaturalLess("e.1", "e.01"));
  EXPECT_TRUE(NaturalLess("e.01", "e.2"));
  EXPECT_TRUE(NaturalLess("e.001", "e.2"));
}

TEST(NaturalOrderTest, SortsCheckpointNames) {
  std::vector<std::string> names = {"model.layers.10.mlp.experts.0.w",
                                    "model.layers.2.mlp.experts.10.w",
                                    "model.layers.2.mlp.experts.9.w",
                                    "model.layers.2.mlp.experts.1.w",
                                    "model.embed_tokens.weight",
                                    "model.layers.1.input_layernorm.weight",
                                    "lm_head.weight"};
  std::sort(names.begin(), names.end(), NaturalLessCompare{});
  EXPECT_THAT(names, ::testing::ElementsAre(
                         "lm_head.weight", "model.embed_tokens.weight",
                         "model.layers.1.input_layernorm.weight", "model.layers.2.mlp.experts.1.w",
                         "model.layers.2.mlp.experts.9.w", "model.layers.2.mlp.experts.10.w",
                         "model.layers.10.mlp.experts.0.w"));
}

TEST(NaturalOrderTest, IsAStrictTotalOrder) {
  // Every string of length <= 3 over an alphabet with digits, a separator on
  // each side of '0'..'9' in ASCII, and a letter.
  const std::string alphabet = "/0019:a";
  std::vector<std::string> all = {""};
  for (int len = 1; len <= 3; ++len) {
    const size_t previous = all.size();
    for (size_t idx = 0; idx < previous; ++idx) {
      if (all[idx].size() != static_cast<size_t>(len - 1)) continue;
      for (char c : alphabet) all.push_back(all[idx] + c);
    }
  }
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  for (const std::string& a : all) {
    EXPECT_FALSE(NaturalLess(a, a)) << a;
    for (const std::string& b : all) {
      const bool ab = NaturalLess(a, b);
      const bool ba = NaturalLess(b, a);
      ASSERT_FALSE(ab && ba) << a << " vs " << b;
      ASSERT_EQ(ab || ba, a != b) << a << " vs " << b;  // total: only equal strings tie
    }
  }
  // Transitivity, checked through sort consistency: every adjacent pair ordered.
  std::vector<std::string> sorted = all;
  std::sort(sorted.begin(), sorted.end(), NaturalLessCompare{});
  for (size_t idx = 0; idx + 1 < sorted.size(); ++idx) {
    for (size_t later = idx + 1; later < sorted.size(); ++later) {
      ASSERT_TRUE(NaturalLess(sorted[idx], sorted[later])) << sorted[idx] << " " << sorted[later];
    }
  }
}

}  // namespace
}  // namespace moefit::checkpoint
