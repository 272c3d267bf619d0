// Mapping tables: every compiled-in table parses, patterns match only decimal
// indices, and errors in a table point at its file and line.
#include "checkpoint/mapping_table.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

namespace moefit::checkpoint {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Optional;

TEST(MappingTableTest, EveryRegisteredFamilyParses) {
  EXPECT_THAT(RegisteredFamilies(),
              ElementsAre("deepseek_v3", "glm4_moe", "mixtral", "qwen2_moe", "qwen3_moe"));
  for (const std::string& family : RegisteredFamilies()) {
    absl::StatusOr<MappingTable> table = MappingTableFor(family);
    ASSERT_TRUE(table.ok()) << table.status();
    EXPECT_EQ(table->family, family);
    EXPECT_EQ(table->file, "checkpoint/mappings/" + family + ".textproto");
    EXPECT_FALSE(table->rules.empty());
  }
  absl::StatusOr<MappingTable> unknown = MappingTableFor("llama");
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(unknown.status().message(), HasSubstr("qwen3_moe"));
}

TEST(MappingTableTest, ExpertRulesOfQwen3) {
  absl::StatusOr<MappingTable> table = MappingTableFor("qwen3_moe");
  ASSERT_TRUE(table.ok()) << table.status();
  const MappingRule& gate_up = table->rules[0];
  EXPECT_TRUE(gate_up.merges_experts());
  EXPECT_EQ(gate_up.target.text(), "model.layers.*.mlp.experts.gate_up_proj");
  const std::vector<ConversionOp> reverse = gate_up.ReverseOps();
  ASSERT_EQ(reverse.size(), 2u);
  EXPECT_EQ(reverse[0].DebugString(), "chunk(dim=1, num_chunks=2)");
  EXPECT_EQ(reverse[1].DebugString(), "split_modulelist(dim=0)");
}

TEST(KeyPatternTest, MatchesDecimalIndices) {
  const KeyPattern pattern("model.layers.*.mlp.experts.*.up_proj.weight");
  EXPECT_EQ(pattern.num_wildcards(), 2);
  EXPECT_THAT(pattern.Match("model.layers.3.mlp.experts.17.up_proj.weight"),
              Optional(ElementsAre(3, 17)));
  EXPECT_EQ(pattern.Match("model.layers.3.mlp.experts.x.up_proj.weight"), std::nullopt);
  EXPECT_EQ(pattern.Match("model.layers.03.mlp.experts.1.up_proj.weight"), std::nullopt);
  EXPECT_EQ(pattern.Match("model.layers.3.mlp.experts.1.up_proj.weight.x"), std::nullopt);
  EXPECT_EQ(pattern.Fill({10, 0}), "model.layers.10.mlp.experts.0.up_proj.weight");
}

TEST(MappingTableTest, SyntaxErrorNamesFileAndLine) {
  absl::StatusOr<MappingTable> table =
      ParseMappingTable("family: \"x\"\nrule {\n  sauce: \"a\"\n}\n", "mappings/x.textproto");
  ASSERT_FALSE(table.ok());
  EXPECT_THAT(table.status().message(), HasSubstr("mappings/x.textproto:3:"));
  EXPECT_THAT(table.status().message(), HasSubstr("sauce"));
}

TEST(MappingTableTest, RuleErrorsNameFileAndLine) {
  struct Case {
    const char* rule;
    const char* error;
  };
  const Case cases[] = {
      {"rule { source: \"a.*.x\" target: \"a.x\" }", "has 0 '*', needs 1"},
      {"rule { source: \"a.*.x\" source: \"a.*.y\" target: \"a.xy\" op { merge_modulelist {} } }",
       "must concatenate"},
      {"rule { source: \"a.x\" op { transpose { dim0: 1 dim1: 1 } } }", "two different dims"},
      {"rule { source: \"a.x\" op { cast { dtype: \"F17\" } } }", "unknown dtype"},
      {"rule { source: \"a.x\" op { chunk { dim: 0 num_chunks: 2 } } }", "one target"},
      {"rule { source: \"a.x\" op { concatenate { dim: 0 } } }", "several sources"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.rule);
    const std::string text = std::string("family: \"x\"\n\n") + c.rule + "\n";
    absl::StatusOr<MappingTable> table = ParseMappingTable(text, "t.textproto");
    ASSERT_FALSE(table.ok());
    const std::string message(table.status().message());
    EXPECT_THAT(message, HasSubstr("t.textproto:3"));
    EXPECT_THAT(message, HasSubstr(c.error));
  }
}

}  // namespace
}  // namespace moefit::checkpoint
