// The WeightConverter pipeline end to end on tiny generated checkpoints.
//
// Each test writes a checkpoint in a family's real Hub key names (2 layers, a few
// experts, random BF16 values, sharded over 3 files with an index), then checks
// what a user would: HF -> packed -> HF gives the same keys and bytes; the packed
// tensors equal a hand-stacked reference; a rank's expert slice reads exactly
// its own experts' bytes and equals that slice of a full load; one report names
// every missing, unexpected and mis-shaped tensor; caller-given destinations are
// filled in place, and unusable ones are named before anything is read; the
// packed, transposed and interleaved gpt-oss layout round-trips; expert 10 comes
// after expert 9; and the two-phase export written by two "ranks" in one process
// reloads to the original.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/conversion_ops.h"
#include "checkpoint/mapping_table.h"
#include "checkpoint/natural_order.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/safetensors_index.h"
#include "checkpoint/tensor_io.h"
#include "checkpoint/weight_exporter.h"
#include "checkpoint/weight_loader.h"
#include "tests/checkpoint/loader_test_util.h"

namespace moefit::checkpoint {
namespace {

using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
using TensorMap = std::map<std::string, at::Tensor>;

constexpr int64_t kNumLayers = 2;
constexpr int64_t kHidden = 8;
constexpr int64_t kInter = 4;
constexpr int64_t kVocab = 16;

struct ExpertNames {
  std::string prefix;  // "model.layers.{L}.mlp.experts." without the layer
  std::string gate;
  std::string up;
  std::string down;
  std::string router;  // on-disk router name after "model.layers.{L}."
};

ExpertNames NamesOf(const std::string& family) {
  if (family == "mixtral") {
    return {"block_sparse_moe.experts.", "w1.weight", "w3.weight", "w2.weight",
            "block_sparse_moe.gate.weight"};
  }
  return {"mlp.experts.", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
          "mlp.gate.weight"};
}

std::string Layer(int64_t layer_idx) { return "model.layers." + std::to_string(layer_idx) + "."; }

std::string ExpertKey(const std::string& family, int64_t layer_idx, int64_t expert_idx,
                      const std::string& which) {
  return Layer(layer_idx) + NamesOf(family).prefix + std::to_string(expert_idx) + "." + which;
}

at::Tensor Random(at::IntArrayRef shape, at::ScalarType dtype = at::kBFloat16) {
  return at::randn(shape, at::kFloat).to(dtype);
}

// The on-disk tensors of a tiny model of `family`, in natural order.
NamedTensors HubTensors(const std::string& family, int64_t num_experts) {
  at::manual_seed(7);
  NamedTensors t;
  t.emplace_back("model.embed_tokens.weight", Random({kVocab, kHidden}));
  t.emplace_back("model.norm.weight", Random({kHidden}, at::kFloat));
  t.emplace_back("lm_head.weight", Random({kVocab, kHidden}));
  const ExpertNames names = NamesOf(family);
  for (int64_t layer_idx = 0; layer_idx < kNumLayers; ++layer_idx) {
    const std::string l = Layer(layer_idx);
    t.emplace_back(l + "input_layernorm.weight", Random({kHidden}, at::kFloat));
    t.emplace_back(l + "post_attention_layernorm.weight", Random({kHidden}, at::kFloat));
    if (family == "deepseek_v3") {
      // Multi-head latent attention (q_lora_rank 4, kv_lora_rank 4, rope dim 2).
      t.emplace_back(l + "self_attn.q_a_proj.weight", Random({4, kHidden}));
      t.emplace_back(l + "self_attn.q_a_layernorm.weight", Random({4}));
      t.emplace_back(l + "self_attn.q_b_proj.weight", Random({kHidden, 4}));
      t.emplace_back(l + "self_attn.kv_a_proj_with_mqa.weight", Random({6, kHidden}));
      t.emplace_back(l + "self_attn.kv_a_layernorm.weight", Random({4}));
      t.emplace_back(l + "self_attn.kv_b_proj.weight", Random({kHidden, 4}));
      t.emplace_back(l + "self_attn.o_proj.weight", Random({kHidden, kHidden}));
    } else {
      for (const char* proj : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
        t.emplace_back(l + "self_attn." + proj + ".weight", Random({kHidden, kHidden}));
        if ((family == "qwen2_moe" || family == "glm4_moe") && std::string(proj) != "o_proj") {
          t.emplace_back(l + "self_attn." + proj + ".bias", Random({kHidden}));
        }
      }
    }
    if (family == "deepseek_v3" || family == "glm4_moe") {
      for (const char* proj : {"gate_proj", "up_proj"}) {
        t.emplace_back(l + "mlp.shared_experts." + proj + ".weight", Random({kInter, kHidden}));
      }
      t.emplace_back(l + "mlp.shared_experts.down_proj.weight", Random({kHidden, kInter}));
      t.emplace_back(l + "mlp.gate.e_score_correction_bias", Random({num_experts}, at::kFloat));
    }
    if (family == "qwen3_moe" || family == "glm4_moe") {
      t.emplace_back(l + "self_attn.q_norm.weight", Random({kHidden / 2}));
      t.emplace_back(l + "self_attn.k_norm.weight", Random({kHidden / 2}));
    }
    if (family == "qwen2_moe") {
      t.emplace_back(l + "mlp.shared_expert.gate_proj.weight", Random({kInter, kHidden}));
      t.emplace_back(l + "mlp.shared_expert.up_proj.weight", Random({kInter, kHidden}));
      t.emplace_back(l + "mlp.shared_expert.down_proj.weight", Random({kHidden, kInter}));
      t.emplace_back(l + "mlp.shared_expert_gate.weight", Random({1, kHidden}));
    }
    t.emplace_back(l + names.router, Random({num_experts, kHidden}));
    for (int64_t e = 0; e < num_experts; ++e) {
      t.emplace_back(ExpertKey(family, layer_idx, e, names.gate), Random({kInter, kHidden}));
      t.emplace_back(ExpertKey(family, layer_idx, e, names.up), Random({kInter, kHidden}));
      t.emplace_back(ExpertKey(family, layer_idx, e, names.down), Random({kHidden, kInter}));
    }
  }
  std::sort(t.begin(), t.end(),
            [](const auto& a, const auto& b) { return NaturalLess(a.first, b.first); });
  return t;
}

// Writes `tensors` as `num_shards` consecutive shards plus an index.
void WriteSharded(const std::filesystem::path& dir, const NamedTensors& tensors, int num_shards) {
  std::filesystem::create_directories(dir);
  ShardedIndex index;
  const size_t per_shard = (tensors.size() + num_shards - 1) / num_shards;
  for (int shard_idx = 0; shard_idx < num_shards; ++shard_idx) {
    const std::string file = ShardFileName(shard_idx, num_shards);
    NamedTensors shard;
    for (size_t i = shard_idx * per_shard;
         i < std::min(tensors.size(), (shard_idx + 1) * per_shard); ++i) {
      shard.push_back(tensors[i]);
      index.weight_map[tensors[i].first] = file;
      index.total_size += tensors[i].second.nbytes();
    }
    ASSERT_TRUE(SaveTensors(dir / file, shard, {.sync = false}).ok());
  }
  ASSERT_TRUE(WriteShardedIndex(dir / std::string(kIndexFileName), index).ok());
}

// Every tensor of every *.safetensors in `dir`, as owned copies.
TensorMap ReadAll(const std::filesystem::path& dir) {
  TensorMap out;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(entry.path());
    EXPECT_TRUE(file.ok()) << file.status();
    for (const TensorInfo& info : file->tensors()) {
      absl::StatusOr<at::Tensor> t = ReadTensor(*file, info, {.copy = true});
      EXPECT_TRUE(t.ok()) << t.status();
      EXPECT_TRUE(out.emplace(info.name, *t).second) << info.name << " twice";
    }
  }
  return out;
}

void ExpectSameTensors(const TensorMap& actual, const NamedTensors& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& [name, tensor] : expected) {
    const auto it = actual.find(name);
    ASSERT_NE(it, actual.end()) << name;
    EXPECT_TRUE(SameBytes(it->second, tensor)) << name;
  }
}

const at::Tensor& Get(const NamedTensors& tensors, const std::string& name) {
  for (const auto& [n, t] : tensors) {
    if (n == name) return t;
  }
  ADD_FAILURE() << "no " << name;
  static const at::Tensor kNone;
  return kNone;
}

class ConverterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Parameterized test names hold a '/'.
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ = std::filesystem::path(::testing::TempDir()) / ("moefit_conv_" + name);
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::filesystem::path dir_;
};

class FamilyTest : public ConverterTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(FamilyTest, HubToPackedToHubIsByteIdentical) {
  const std::string family = GetParam();
  const NamedTensors hub = HubTensors(family, 4);
  WriteSharded(dir_ / "in", hub, 3);

  LoadReport report;
  absl::StatusOr<TensorMap> runtime = LoadCheckpoint(dir_ / "in", family, {}, &report);
  ASSERT_TRUE(runtime.ok()) << runtime.status();
  EXPECT_TRUE(report.ok()) << report.ProblemSummary();
  EXPECT_EQ(report.num_global_experts, 4);
  EXPECT_EQ(report.num_files_opened, 3);
  EXPECT_TRUE(runtime->contains("model.layers.1.mlp.experts.gate_up_proj"));
  EXPECT_TRUE(runtime->contains("model.layers.1.mlp.gate.weight"));

  // Small shards, so the export is sharded too.
  const absl::Status saved =
      SaveCheckpoint(dir_ / "out", family, *runtime, {.max_shard_bytes = 1500, .sync = false});
  ASSERT_TRUE(saved.ok()) << saved;
  ExpectSameTensors(ReadAll(dir_ / "out"), hub);
  absl::StatusOr<ShardedIndex> index = ReadShardedIndex(dir_ / "out" / std::string(kIndexFileName));
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->weight_map.size(), hub.size());
  const std::vector<std::string> files = index->ShardFiles();
  ASSERT_GT(files.size(), 1u);
  EXPECT_EQ(files.back(), ShardFileName(files.size() - 1, files.size()));
}

TEST_P(FamilyTest, PackedEqualsHandStackedReference) {
  const std::string family = GetParam();
  const NamedTensors hub = HubTensors(family, 5);
  WriteSharded(dir_, hub, 2);
  absl::StatusOr<TensorMap> runtime = LoadCheckpoint(dir_, family);
  ASSERT_TRUE(runtime.ok()) << runtime.status();
  const ExpertNames names = NamesOf(family);
  for (int64_t layer_idx = 0; layer_idx < kNumLayers; ++layer_idx) {
    std::vector<at::Tensor> gates, ups, downs;
    for (int64_t e = 0; e < 5; ++e) {
      gates.push_back(Get(hub, ExpertKey(family, layer_idx, e, names.gate)));
      ups.push_back(Get(hub, ExpertKey(family, layer_idx, e, names.up)));
      downs.push_back(Get(hub, ExpertKey(family, layer_idx, e, names.down)));
    }
    const std::string l = Layer(layer_idx);
    EXPECT_TRUE(SameBytes(runtime->at(l + "mlp.experts.gate_up_proj"),
                          at::cat({at::stack(gates), at::stack(ups)}, 1)));
    EXPECT_TRUE(SameBytes(runtime->at(l + "mlp.experts.down_proj"), at::stack(downs)));
    EXPECT_TRUE(SameBytes(runtime->at(l + "mlp.gate.weight"), Get(hub, l + names.router)));
    EXPECT_EQ(runtime->at(l + "mlp.experts.gate_up_proj").sizes(),
              (at::IntArrayRef{5, 2 * kInter, kHidden}));
  }
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyTest,
                         ::testing::Values("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3",
                                           "glm4_moe"));

// The model's view of a full load, with `num` experts per expert tensor.
std::map<std::string, ExpectedTensor> ExpectedFor(const TensorMap& full, int64_t num) {
  std::map<std::string, ExpectedTensor> expected;
  for (const auto& [name, t] : full) {
    std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
    if (name.find(".mlp.experts.") != std::string::npos) shape[0] = num;
    expected[name] = {shape, t.scalar_type()};
  }
  return expected;
}

TEST_F(ConverterTest, ExpertSlicesReadOnlyTheirOwnBytes) {
  const std::string family = "qwen3_moe";
  const NamedTensors hub = HubTensors(family, 4);
  WriteSharded(dir_, hub, 3);
  LoadReport full_report;
  absl::StatusOr<TensorMap> full = LoadCheckpoint(dir_, family, {}, &full_report);
  ASSERT_TRUE(full.ok()) << full.status();
  uint64_t all_bytes = 0;
  for (const auto& [name, t] : hub) all_bytes += t.nbytes();
  EXPECT_EQ(full_report.num_bytes_read, all_bytes);

  for (int64_t first : {0, 2}) {
    SCOPED_TRACE(first);
    uint64_t expected_bytes = 0;
    for (const auto& [name, t] : hub) {
      const bool is_expert = name.find(".mlp.experts.") != std::string::npos;
      const bool mine =
          name.find(".experts." + std::to_string(first) + ".") != std::string::npos ||
          name.find(".experts." + std::to_string(first + 1) + ".") != std::string::npos;
      if (!is_expert || mine) expected_bytes += t.nbytes();
    }
    LoadOptions options{.first_expert = first,
                        .num_experts = 2,
                        .num_threads = 2,
                        .expected = ExpectedFor(*full, 2)};
    LoadReport report;
    absl::StatusOr<TensorMap> slice = LoadCheckpoint(dir_, family, options, &report);
    ASSERT_TRUE(slice.ok()) << slice.status();
    EXPECT_EQ(report.num_bytes_read, expected_bytes);
    EXPECT_LT(report.num_bytes_read, all_bytes);
    for (const auto& [name, t] : *full) {
      const at::Tensor want =
          name.find(".mlp.experts.") != std::string::npos ? t.narrow(0, first, 2) : t;
      EXPECT_TRUE(SameBytes(slice->at(name), want)) << name;
    }
  }
}

TEST_F(ConverterTest, LoadOnlyDenseOpensNoExpertOnlyShard) {
  // With an index, a rank that wants no experts opens only the shards it needs.
  NamedTensors hub = HubTensors("qwen3_moe", 4);
  WriteSharded(dir_, hub, 3);
  std::map<std::string, ExpectedTensor> expected;
  expected["model.embed_tokens.weight"] = {{kVocab, kHidden}, at::kBFloat16};
  LoadReport report;
  LoadOptions options{.expected = expected};
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_, "qwen3_moe", options, &report);
  // Every other tensor is unexpected for this model, and that is reported...
  EXPECT_FALSE(loaded.ok());
  EXPECT_EQ(report.unexpected.size(), hub.size() - 1);
  // ... but only the embedding's shard was opened.
  EXPECT_EQ(report.num_files_opened, 1);
}

TEST_F(ConverterTest, OneReportNamesMissingUnexpectedAndMisshaped) {
  const std::string family = "qwen3_moe";
  NamedTensors hub = HubTensors(family, 4);
  WriteSharded(dir_ / "good", hub, 2);
  absl::StatusOr<TensorMap> full = LoadCheckpoint(dir_ / "good", family);
  ASSERT_TRUE(full.ok()) << full.status();
  std::map<std::string, ExpectedTensor> expected = ExpectedFor(*full, 4);
  expected["model.layers.1.self_attn.o_proj.weight"].shape = {kHidden, kHidden + 1};
  expected["model.layers.0.self_attn.extra.weight"] = {{kHidden}, at::kFloat};

  const std::string dropped = "model.layers.1.mlp.experts.3.up_proj.weight";
  std::erase_if(hub, [&](const auto& entry) { return entry.first == dropped; });
  hub.emplace_back("model.layers.0.mlp.stray.weight", Random({2}));
  hub.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", Random({2}, at::kFloat));
  WriteSharded(dir_ / "bad", hub, 2);

  LoadReport report;
  LoadOptions options{.expected = expected};
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_ / "bad", family, options, &report);
  ASSERT_FALSE(loaded.ok());
  EXPECT_THAT(report.missing,
              UnorderedElementsAre(dropped, "model.layers.0.self_attn.extra.weight"));
  EXPECT_THAT(report.unexpected, UnorderedElementsAre("model.layers.0.mlp.stray.weight"));
  ASSERT_EQ(report.mismatched.size(), 1u);
  EXPECT_THAT(report.mismatched[0], HasSubstr("model.layers.1.self_attn.o_proj.weight"));
  EXPECT_THAT(report.mismatched[0], HasSubstr("[8, 9]"));
  EXPECT_THAT(report.ignored, UnorderedElementsAre("model.layers.0.self_attn.rotary_emb.inv_freq"));
  EXPECT_EQ(report.num_bytes_read, 0u);  // nothing read before the plan is clean
  const std::string message(loaded.status().message());
  for (const std::string& name : {dropped, std::string("model.layers.0.mlp.stray.weight"),
                                  std::string("model.layers.1.self_attn.o_proj.weight"),
                                  std::string("model.layers.0.self_attn.extra.weight")}) {
    EXPECT_THAT(message, HasSubstr(name));
  }
  EXPECT_THAT(message, Not(HasSubstr("inv_freq")));
}

TEST_F(ConverterTest, ExpectedDtypeConverts) {
  const NamedTensors hub = HubTensors("mixtral", 4);
  WriteSharded(dir_, hub, 1);
  absl::StatusOr<TensorMap> full = LoadCheckpoint(dir_, "mixtral");
  ASSERT_TRUE(full.ok()) << full.status();
  std::map<std::string, ExpectedTensor> expected = ExpectedFor(*full, 4);
  for (auto& [name, e] : expected) e.dtype = at::kFloat;
  absl::StatusOr<TensorMap> as_f32 = LoadCheckpoint(dir_, "mixtral", {.expected = expected});
  ASSERT_TRUE(as_f32.ok()) << as_f32.status();
  for (const auto& [name, t] : *full) {
    EXPECT_EQ(as_f32->at(name).scalar_type(), at::kFloat) << name;
    EXPECT_TRUE(SameBytes(as_f32->at(name), t.to(at::kFloat))) << name;
  }
}

// A model's own tensors as destinations: filled where they are (the returned
// map holds the very same tensors), by every fill path: pread() for experts in
// their stored dtype, converting copies for the dense part in fp32.
TEST_F(ConverterTest, DestinationsAreFilledInPlace) {
  const std::string family = "qwen3_moe";
  WriteSharded(dir_, HubTensors(family, 4), 3);
  absl::StatusOr<TensorMap> full = LoadCheckpoint(dir_, family);
  ASSERT_TRUE(full.ok()) << full.status();
  LoadOptions options{
      .first_expert = 2, .num_experts = 2, .num_threads = 2, .expected = ExpectedFor(*full, 2)};
  for (auto& [name, e] : options.expected) {
    if (name.find(".mlp.experts.") == std::string::npos) e.dtype = at::kFloat;
    // Parameters require grad; the loader must fill them all the same.
    options.destinations[name] =
        at::empty(e.shape, at::TensorOptions().dtype(e.dtype)).requires_grad_(true);
  }
  LoadReport report;
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_, family, options, &report);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(report.ok()) << report.ProblemSummary();
  ASSERT_EQ(loaded->size(), options.destinations.size());
  for (const auto& [name, dst] : options.destinations) {
    EXPECT_TRUE(loaded->at(name).is_same(dst)) << name;
    EXPECT_TRUE(dst.requires_grad()) << name;
    const at::Tensor& t = full->at(name);
    const at::Tensor want =
        name.find(".mlp.experts.") != std::string::npos ? t.narrow(0, 2, 2) : t.to(at::kFloat);
    EXPECT_TRUE(SameBytes(dst.detach(), want)) << name;
  }
}

// Destinations of the wrong kind are a caller's error: every one is named at
// once, after the plan and before anything is read.
TEST_F(ConverterTest, UnusableDestinationsAreNamedBeforeAnyRead) {
  const std::string family = "qwen3_moe";
  WriteSharded(dir_, HubTensors(family, 4), 2);
  absl::StatusOr<TensorMap> full = LoadCheckpoint(dir_, family);
  ASSERT_TRUE(full.ok()) << full.status();
  LoadOptions options{.expected = ExpectedFor(*full, 4)};
  const std::string down = "model.layers.0.mlp.experts.down_proj";
  options.destinations = {
      {"model.embed_tokens.weight", at::empty({kVocab, kHidden + 1}, at::kBFloat16)},
      {"model.norm.weight", at::empty({kHidden}, at::kBFloat16)},  // stored and expected fp32
      {"lm_head.weight", at::empty({kHidden, kVocab}, at::kBFloat16).t()},
      {"model.layers.0.mlp.nothing", at::empty({1})},
      {down, at::zeros({4, kHidden, kInter}, at::kBFloat16)},  // a good one
  };
  LoadReport report;
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_, family, options, &report);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(report.ok()) << report.ProblemSummary();  // the checkpoint is fine
  EXPECT_EQ(report.num_bytes_read, 0u);
  const std::string message(loaded.status().message());
  EXPECT_THAT(message, HasSubstr("4 unusable destinations"));
  EXPECT_THAT(message, HasSubstr("model.embed_tokens.weight: destination is BFloat16 [16, 9]"));
  EXPECT_THAT(message, HasSubstr("model.norm.weight: destination is BFloat16 [8] on cpu, the "
                                 "target is Float [8]"));
  EXPECT_THAT(message, HasSubstr("lm_head.weight: destination is non-contiguous"));
  EXPECT_THAT(message, HasSubstr("model.layers.0.mlp.nothing: not a tensor this load produces"));
  EXPECT_THAT(message, Not(HasSubstr(down)));
  EXPECT_EQ(options.destinations.at(down).count_nonzero().item<int64_t>(), 0);
}

TEST_F(ConverterTest, ExpertTenComesAfterExpertNine) {
  const std::string family = "qwen2_moe";
  constexpr int64_t kNumExperts = 12;
  const NamedTensors hub = HubTensors(family, kNumExperts);
  WriteSharded(dir_ / "in", hub, 3);
  absl::StatusOr<TensorMap> runtime = LoadCheckpoint(dir_ / "in", family);
  ASSERT_TRUE(runtime.ok()) << runtime.status();
  const at::Tensor& down = runtime->at("model.layers.0.mlp.experts.down_proj");
  for (int64_t e = 0; e < kNumExperts; ++e) {
    EXPECT_TRUE(SameBytes(down[e], Get(hub, ExpertKey(family, 0, e, "down_proj.weight")))) << e;
  }
  // A slice across the 9/10 boundary.
  LoadOptions options{.first_expert = 9, .num_experts = 3};
  absl::StatusOr<TensorMap> slice = LoadCheckpoint(dir_ / "in", family, options);
  ASSERT_TRUE(slice.ok()) << slice.status();
  EXPECT_TRUE(SameBytes(slice->at("model.layers.0.mlp.experts.down_proj")[1],
                        Get(hub, ExpertKey(family, 0, 10, "down_proj.weight"))));
  ASSERT_TRUE(SaveCheckpoint(dir_ / "out", family, *runtime, {.sync = false}).ok());
  ExpectSameTensors(ReadAll(dir_ / "out"), hub);
}

TEST_F(ConverterTest, TwoRankExportWritesGlobalExpertNumbers) {
  const std::string family = "mixtral";
  const NamedTensors hub = HubTensors(family, 4);
  WriteSharded(dir_ / "in", hub, 3);
  std::vector<ExportPlan> plans;
  for (int rank = 0; rank < 2; ++rank) {
    absl::StatusOr<TensorMap> mine =
        LoadCheckpoint(dir_ / "in", family, {.first_expert = 2 * rank, .num_experts = 2});
    ASSERT_TRUE(mine.ok()) << mine.status();
    absl::StatusOr<ExportPlan> plan = PlanExport(family, *mine,
                                                 {.first_expert = 2 * rank,
                                                  .write_dense = rank == 0,
                                                  .max_shard_bytes = 2000,
                                                  .sync = false});
    ASSERT_TRUE(plan.ok()) << plan.status();
    plans.push_back(*std::move(plan));
  }
  // What the caller's all-gather of shard counts would give.
  const int num_total = plans[0].num_shards() + plans[1].num_shards();
  std::map<std::string, std::string> weight_map;
  uint64_t total_bytes = 0;
  int first_shard_idx = 0;
  for (const ExportPlan& plan : plans) {
    absl::StatusOr<std::map<std::string, std::string>> fragment =
        WriteExportShards(dir_ / "out", plan, first_shard_idx, num_total);
    ASSERT_TRUE(fragment.ok()) << fragment.status();
    weight_map.merge(*fragment);
    total_bytes += plan.total_bytes;
    first_shard_idx += plan.num_shards();
  }
  ASSERT_TRUE(WriteIndex(dir_ / "out", weight_map, total_bytes).ok());
  ExpectSameTensors(ReadAll(dir_ / "out"), hub);
  EXPECT_TRUE(std::filesystem::exists(dir_ / "out" / ShardFileName(num_total - 1, num_total)));
  LoadReport report;
  ASSERT_TRUE(LoadCheckpoint(dir_ / "out", family, {}, &report).ok());
  EXPECT_EQ(report.num_files_opened, num_total);
}

// A gpt-oss style table, for the converter's transposing and de-interleaving
// ops: no model family of moefit stores its experts so, but checkpoints do.
constexpr char kGptOssTable[] = R"table(
# gpt_oss (BF16 layout, as transformers' save_pretrained writes a dequantized
# gpt-oss): experts are stored packed per layer but transposed, with gate and up
# interleaved along the last dim (even columns gate, odd columns up),
#   model.layers.{L}.mlp.experts.gate_up_proj       [E, H, 2I]
#   model.layers.{L}.mlp.experts.gate_up_proj_bias  [E, 2I]   (interleaved)
#   model.layers.{L}.mlp.experts.down_proj          [E, I, H]
#   model.layers.{L}.mlp.experts.down_proj_bias     [E, H]
#   model.layers.{L}.mlp.router.{weight,bias}       [E, H], [E]
# moefit's runtime layout is gate_up_proj [E, 2I, H] with gate rows first and
# down_proj [E, H, I]: a transpose plus a deinterleave, nothing family-specific
# in code. moefit has no gpt_oss model yet; the tests use this table to exercise
# the packed, transposed and interleaved operations. (The released checkpoints
# are MXFP4 blocks + scales, which would need a dequantizing op.)
# schema: proto/checkpoint_mapping.proto (moefit.proto.MappingTable)
family: "gpt_oss"

rule {
  source: "model.layers.*.mlp.experts.gate_up_proj"
  op { transpose { dim0: 1 dim1: 2 } }
  op { deinterleave { dim: 1 } }
  packed_experts: true
}
rule {
  source: "model.layers.*.mlp.experts.gate_up_proj_bias"
  op { deinterleave { dim: 1 } }
  packed_experts: true
}
rule {
  source: "model.layers.*.mlp.experts.down_proj"
  op { transpose { dim0: 1 dim1: 2 } }
  packed_experts: true
}
rule {
  source: "model.layers.*.mlp.experts.down_proj_bias"
  packed_experts: true
}
rule {
  source: "model.layers.*.mlp.router.weight"
  target: "model.layers.*.mlp.gate.weight"
}
rule {
  source: "model.layers.*.mlp.router.bias"
  target: "model.layers.*.mlp.gate.bias"
}

rule { source: "model.embed_tokens.weight" }
rule { source: "model.norm.weight" }
rule { source: "lm_head.weight" }
rule { source: "model.layers.*.input_layernorm.weight" }
rule { source: "model.layers.*.post_attention_layernorm.weight" }
rule { source: "model.layers.*.self_attn.q_proj.weight" }
rule { source: "model.layers.*.self_attn.q_proj.bias" }
rule { source: "model.layers.*.self_attn.k_proj.weight" }
rule { source: "model.layers.*.self_attn.k_proj.bias" }
rule { source: "model.layers.*.self_attn.v_proj.weight" }
rule { source: "model.layers.*.self_attn.v_proj.bias" }
rule { source: "model.layers.*.self_attn.o_proj.weight" }
rule { source: "model.layers.*.self_attn.o_proj.bias" }
rule { source: "model.layers.*.self_attn.sinks" }
)table";

const MappingTable& GptOssTable() {
  static const MappingTable table = [] {
    absl::StatusOr<MappingTable> parsed = ParseMappingTable(kGptOssTable, "gpt_oss test table");
    EXPECT_TRUE(parsed.ok()) << parsed.status();
    return parsed.ok() ? *std::move(parsed) : MappingTable{};
  }();
  return table;
}

// gpt-oss layout: packed [E, H, 2I] with gate/up interleaved on the last dim.
TEST_F(ConverterTest, GptOssStylePackedTransposedInterleavedRoundTrips) {
  constexpr int64_t kNumExperts = 4;
  at::manual_seed(11);
  NamedTensors hub;
  hub.emplace_back("model.embed_tokens.weight", Random({kVocab, kHidden}));
  for (int64_t layer_idx = 0; layer_idx < kNumLayers; ++layer_idx) {
    const std::string l = Layer(layer_idx);
    hub.emplace_back(l + "mlp.experts.gate_up_proj", Random({kNumExperts, kHidden, 2 * kInter}));
    hub.emplace_back(l + "mlp.experts.gate_up_proj_bias", Random({kNumExperts, 2 * kInter}));
    hub.emplace_back(l + "mlp.experts.down_proj", Random({kNumExperts, kInter, kHidden}));
    hub.emplace_back(l + "mlp.experts.down_proj_bias", Random({kNumExperts, kHidden}));
    hub.emplace_back(l + "mlp.router.weight", Random({kNumExperts, kHidden}));
    hub.emplace_back(l + "mlp.router.bias", Random({kNumExperts}));
    hub.emplace_back(l + "self_attn.sinks", Random({2}));
  }
  WriteSharded(dir_ / "in", hub, 2);
  absl::StatusOr<TensorMap> runtime = LoadCheckpoint(dir_ / "in", GptOssTable());
  ASSERT_TRUE(runtime.ok()) << runtime.status();

  const at::Tensor& disk = Get(hub, "model.layers.1.mlp.experts.gate_up_proj");  // [E, H, 2I]
  const at::Tensor gate = disk.slice(2, 0, 2 * kInter, 2).transpose(1, 2);       // even columns
  const at::Tensor up = disk.slice(2, 1, 2 * kInter, 2).transpose(1, 2);         // odd columns
  EXPECT_TRUE(
      SameBytes(runtime->at("model.layers.1.mlp.experts.gate_up_proj"), at::cat({gate, up}, 1)));
  EXPECT_TRUE(SameBytes(runtime->at("model.layers.1.mlp.experts.down_proj"),
                        Get(hub, "model.layers.1.mlp.experts.down_proj").transpose(1, 2)));
  EXPECT_TRUE(SameBytes(runtime->at("model.layers.1.mlp.gate.weight"),
                        Get(hub, "model.layers.1.mlp.router.weight")));

  ASSERT_TRUE(SaveCheckpoint(dir_ / "out", GptOssTable(), *runtime, {.sync = false}).ok());
  ExpectSameTensors(ReadAll(dir_ / "out"), hub);

  // A rank's slice of a packed source reads only its rows.
  LoadReport report;
  absl::StatusOr<TensorMap> slice =
      LoadCheckpoint(dir_ / "in", GptOssTable(), {.first_expert = 2, .num_experts = 2}, &report);
  ASSERT_TRUE(slice.ok()) << slice.status();
  uint64_t expected_bytes = 0;
  for (const auto& [name, t] : hub) {
    expected_bytes += name.find(".mlp.experts.") != std::string::npos ? t.nbytes() / 2 : t.nbytes();
  }
  EXPECT_EQ(report.num_bytes_read, expected_bytes);
  EXPECT_TRUE(SameBytes(slice->at("model.layers.1.mlp.experts.gate_up_proj"),
                        runtime->at("model.layers.1.mlp.experts.gate_up_proj").narrow(0, 2, 2)));
  // One rank cannot write part of a packed on-disk tensor.
  EXPECT_FALSE(PlanExport(GptOssTable(), *slice, {.first_expert = 2}).ok());
}

TEST_F(ConverterTest, ExportRejectsUnknownRuntimeTensor) {
  TensorMap tensors{{"model.layers.0.mlp.mystery", at::zeros({2})}};
  absl::StatusOr<ExportPlan> plan = PlanExport("qwen3_moe", tensors);
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(), HasSubstr("model.layers.0.mlp.mystery"));
}

// The weight dtype is the one most weight elements are stored in, found
// through the index or, without one, every shard's header: float32
// embeddings, head and routers in a shard of their own do not make a
// bfloat16 checkpoint float32.
TEST_F(ConverterTest, StoredWeightDtypeIsTheDtypeOfMostWeights) {
  NamedTensors hub = HubTensors("qwen3_moe", 4);
  WriteSharded(dir_, hub, 3);
  absl::StatusOr<at::ScalarType> dtype = StoredWeightDtype(dir_);
  ASSERT_TRUE(dtype.ok()) << dtype.status();
  EXPECT_EQ(*dtype, at::kBFloat16);

  std::filesystem::remove_all(dir_);
  std::filesystem::create_directories(dir_);
  NamedTensors wide, narrow;
  for (const auto& [name, t] : hub) {
    const bool keep_wide = !name.starts_with("model.layers.") || name.ends_with("mlp.gate.weight");
    (keep_wide ? wide : narrow).emplace_back(name, keep_wide ? t.to(at::kFloat) : t);
  }
  ASSERT_TRUE(SaveTensors(dir_ / "a-wide.safetensors", wide, {.sync = false}).ok());
  ASSERT_TRUE(SaveTensors(dir_ / "b-layers.safetensors", narrow, {.sync = false}).ok());
  dtype = StoredWeightDtype(dir_);
  ASSERT_TRUE(dtype.ok()) << dtype.status();
  EXPECT_EQ(*dtype, at::kBFloat16);

  // The same weights all in float32.
  std::filesystem::remove(dir_ / "b-layers.safetensors");
  for (auto& [name, t] : narrow) t = t.to(at::kFloat);
  ASSERT_TRUE(SaveTensors(dir_ / "b-layers.safetensors", narrow, {.sync = false}).ok());
  dtype = StoredWeightDtype(dir_);
  ASSERT_TRUE(dtype.ok()) << dtype.status();
  EXPECT_EQ(*dtype, at::kFloat);

  // Only norms: nothing to tell by, and the directory is named.
  std::filesystem::remove_all(dir_);
  std::filesystem::create_directories(dir_);
  ASSERT_TRUE(SaveTensors(dir_ / "model.safetensors", {{"model.norm.weight", at::ones({kHidden})}},
                          {.sync = false})
                  .ok());
  dtype = StoredWeightDtype(dir_);
  ASSERT_FALSE(dtype.ok());
  EXPECT_THAT(dtype.status().message(), HasSubstr(dir_.string()));
}

TEST(ConversionOpsTest, EveryOpIsUndoneByItsInverse) {
  MappingRule rule;
  rule.sources = {KeyPattern("a.*.x"), KeyPattern("a.*.y")};
  rule.target = KeyPattern("a.xy");
  ConversionOp merge{.kind = ConversionOp::Kind::kMergeModulelist, .dim = 0};
  ConversionOp concat{.kind = ConversionOp::Kind::kConcatenate, .dim = 1};
  ConversionOp transpose{.kind = ConversionOp::Kind::kTranspose, .dim = 1, .dim1 = 2};
  ConversionOp interleave{.kind = ConversionOp::Kind::kInterleave, .dim = -1};
  ConversionOp cast{
      .kind = ConversionOp::Kind::kCast, .dtype = Dtype::kF64, .reverse_dtype = Dtype::kF32};
  rule.ops = {merge, concat, transpose, interleave, cast};
  at::manual_seed(3);
  TensorGroups sources(2);
  for (int e = 0; e < 3; ++e) {
    sources[0].push_back(at::randn({4, 6}));
    sources[1].push_back(at::randn({4, 6}));  // chunk splits into equal parts
  }
  absl::StatusOr<TensorGroups> forward = ApplyOps(rule.ops, sources);
  ASSERT_TRUE(forward.ok()) << forward.status();
  EXPECT_EQ((*forward)[0][0].sizes(), (at::IntArrayRef{3, 6, 8}));
  EXPECT_EQ((*forward)[0][0].scalar_type(), at::kDouble);
  const std::vector<ConversionOp> reverse = rule.ReverseOps();
  absl::StatusOr<TensorGroups> back = ApplyOps(reverse, *forward);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->size(), 2u);
  for (int p = 0; p < 2; ++p) {
    ASSERT_EQ((*back)[p].size(), 3u);
    for (int e = 0; e < 3; ++e) EXPECT_TRUE(SameBytes((*back)[p][e], sources[p][e]));
  }
  // Interleave puts halves' rows alternately: [0 1 2 3] -> [0 2 1 3].
  absl::StatusOr<TensorGroups> mixed =
      ApplyOps(std::vector<ConversionOp>{interleave}, TensorGroups{{at::arange(4)}});
  ASSERT_TRUE(mixed.ok());
  EXPECT_TRUE(at::equal((*mixed)[0][0], at::tensor({0, 2, 1, 3}, at::kLong)));
}

TEST(ConversionOpsTest, ErrorsNameTheOp) {
  ConversionOp deinterleave{.kind = ConversionOp::Kind::kDeinterleave, .dim = 0};
  absl::StatusOr<TensorGroups> odd =
      ApplyOps(std::vector<ConversionOp>{deinterleave}, TensorGroups{{at::zeros({3})}});
  ASSERT_FALSE(odd.ok());
  EXPECT_THAT(odd.status().message(), HasSubstr("deinterleave(dim=0)"));
}

}  // namespace
}  // namespace moefit::checkpoint
