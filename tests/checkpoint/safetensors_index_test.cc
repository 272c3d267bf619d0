// model.safetensors.index.json read/write and shard planning.
#include "checkpoint/safetensors_index.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "tests/checkpoint/safetensors_test_util.h"

namespace moefit::checkpoint {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;

class IndexTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           (std::string("moefit_idx_") +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::filesystem::path dir_;
};

std::string ErrorOf(std::string_view json) {
  absl::StatusOr<ShardedIndex> index = ParseShardedIndex(json, "idx.json");
  EXPECT_FALSE(index.ok()) << json;
  return index.ok() ? "" : std::string(index.status().message());
}

TEST_F(IndexTest, WriteThenRead) {
  ShardedIndex index;
  index.total_size = 12345678901;
  index.weight_map = {{"model.layers.0.w", "model-00001-of-00002.safetensors"},
                      {"model.layers.1.w", "model-00002-of-00002.safetensors"},
                      {"lm_head.weight", "model-00002-of-00002.safetensors"}};
  const std::filesystem::path path = dir_ / std::string(kIndexFileName);
  ASSERT_TRUE(WriteShardedIndex(path, index).ok());
  EXPECT_FALSE(std::filesystem::exists(dir_ / "model.safetensors.index.json.tmp"));

  absl::StatusOr<ShardedIndex> read = ReadShardedIndex(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->total_size, index.total_size);
  EXPECT_EQ(read->weight_map, index.weight_map);
  EXPECT_THAT(read->ShardFiles(),
              ElementsAre("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"));
}

TEST_F(IndexTest, ReadsTransformersStyleIndex) {
  // As written by transformers: indented, extra metadata, total_size as float
  // in some older tools.
  absl::StatusOr<ShardedIndex> index = ParseShardedIndex(R"({
  "metadata": {"total_size": 16.0, "total_parameters": 4},
  "weight_map": {"b": "model-00002-of-00002.safetensors",
                 "a": "model-00001-of-00002.safetensors"}
})",
                                                         "idx.json");
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->total_size, 16u);
  EXPECT_THAT(index->weight_map, ElementsAre(Pair("a", "model-00001-of-00002.safetensors"),
                                             Pair("b", "model-00002-of-00002.safetensors")));
}

TEST_F(IndexTest, RejectsBadIndexes) {
  EXPECT_THAT(ErrorOf("{"), HasSubstr("idx.json: malformed JSON"));
  EXPECT_THAT(ErrorOf("[]"), HasSubstr("not a JSON object"));
  EXPECT_THAT(ErrorOf(R"({"metadata":{}})"), HasSubstr("weight_map"));
  EXPECT_THAT(ErrorOf(R"({"weight_map":{"a":1}})"), HasSubstr("tensor \"a\""));
  EXPECT_THAT(ErrorOf(R"({"weight_map":{"a":"../x.safetensors"}})"),
              HasSubstr("tensor \"a\": shard \"../x.safetensors\" is not a plain file name"));
  EXPECT_THAT(ErrorOf(R"({"weight_map":{"a":"/etc/passwd"}})"), HasSubstr("plain file name"));
  EXPECT_THAT(ErrorOf(R"({"weight_map":{"a":"x","a":"y"}})"),
              HasSubstr("duplicate key \"a\" in \"weight_map\""));
  EXPECT_THAT(ErrorOf(R"({"metadata":{"total_size":-1},"weight_map":{}})"),
              HasSubstr("total_size"));
  EXPECT_THAT(ErrorOf(R"({"metadata":{"total_size":1.5},"weight_map":{}})"),
              HasSubstr("total_size"));
}

TEST_F(IndexTest, ReadErrorNamesFile) {
  const std::filesystem::path missing = dir_ / "nope.json";
  absl::StatusOr<ShardedIndex> index = ReadShardedIndex(missing);
  EXPECT_EQ(index.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(index.status().message()), HasSubstr(missing.string()));
  const std::filesystem::path bad = testing::WriteBytes(dir_, "bad.json", "{\"weight_map\": 3}");
  EXPECT_THAT(std::string(ReadShardedIndex(bad).status().message()), HasSubstr(bad.string()));
}

TEST_F(IndexTest, WriterRejectsPathsInShardNames) {
  ShardedIndex index;
  index.weight_map = {{"a", "sub/model.safetensors"}};
  const absl::Status status = WriteShardedIndex(dir_ / "i.json", index);
  EXPECT_THAT(std::string(status.message()), HasSubstr("tensor \"a\""));
}

TEST(ShardPlanTest, FileNames) {
  EXPECT_EQ(ShardFileName(0, 3), "model-00001-of-00003.safetensors");
  EXPECT_EQ(ShardFileName(2, 3), "model-00003-of-00003.safetensors");
  EXPECT_EQ(ShardFileName(9, 163, "adapter"), "adapter-00010-of-00163.safetensors");
}

TEST(ShardPlanTest, GreedyInOrderWithOversizedTensorsAlone) {
  const std::vector<TensorSize> tensors = {{"a", 40}, {"b", 50},  {"c", 20}, {"big", 250},
                                           {"d", 0},  {"e", 100}, {"f", 1}};
  absl::StatusOr<ShardPlan> plan = PlanShards(tensors, {.max_shard_bytes = 100});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->shard_tensors,
              ElementsAre(ElementsAre("a", "b"), ElementsAre("c"), ElementsAre("big"),
                          ElementsAre("d", "e"), ElementsAre("f")));
  EXPECT_THAT(plan->shard_files,
              ElementsAre("model-00001-of-00005.safetensors", "model-00002-of-00005.safetensors",
                          "model-00003-of-00005.safetensors", "model-00004-of-00005.safetensors",
                          "model-00005-of-00005.safetensors"));
  EXPECT_TRUE(plan->needs_index());
  EXPECT_EQ(plan->index.total_size, 461u);
  EXPECT_EQ(plan->index.weight_map.at("big"), "model-00003-of-00005.safetensors");
  EXPECT_EQ(plan->index.weight_map.size(), tensors.size());
}

TEST(ShardPlanTest, OneShardIsASingleFile) {
  const std::vector<TensorSize> tensors = {{"a", 4}, {"b", 4}};
  absl::StatusOr<ShardPlan> plan = PlanShards(tensors, {.max_shard_bytes = 8});
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(plan->shard_files, ElementsAre(std::string(kSingleFileName)));
  EXPECT_FALSE(plan->needs_index());
}

TEST(ShardPlanTest, Errors) {
  const std::vector<TensorSize> dup = {{"a", 4}, {"a", 4}};
  EXPECT_THAT(std::string(PlanShards(dup).status().message()), HasSubstr("\"a\""));
  const std::vector<TensorSize> ok = {{"a", 4}};
  EXPECT_FALSE(PlanShards(ok, {.max_shard_bytes = 0}).ok());
  const std::vector<TensorSize> unnamed = {{"", 4}};
  EXPECT_FALSE(PlanShards(unnamed).ok());
}

}  // namespace
}  // namespace moefit::checkpoint
