// The model families and the checkpoint mapping tables are one list: every
// family registered in framework/families/registry.cc has a compiled-in
// table (checkpoint/mappings/<name>.textproto) and no table is without a
// family, so a model moefit builds always has a way in and out of its
// checkpoints.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "checkpoint/mapping_table.h"
#include "framework/families/family.h"

namespace moefit::framework {
namespace {

TEST(Families, EachFamilyHasItsMappingTableAndEachTableAFamily) {
  std::vector<std::string> families;
  for (const ModelFamily& f : ModelFamilies()) families.push_back(f.name);
  std::sort(families.begin(), families.end());
  EXPECT_EQ(families, checkpoint::RegisteredFamilies());
  for (const std::string& name : families) {
    absl::StatusOr<checkpoint::MappingTable> table = checkpoint::MappingTableFor(name);
    ASSERT_TRUE(table.ok()) << table.status();
    EXPECT_EQ(table->family, name);
  }
}

}  // namespace
}  // namespace moefit::framework
