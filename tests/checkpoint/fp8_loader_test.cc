// Block-scaled FP8 checkpoints and skipped MTP layers, end to end.
//
// The tests write a tiny DeepSeek-V3-style checkpoint: FP8 (E4M3) Linear weights
// of sizes that are not multiples of the 128 x 128 block, so edge blocks are
// partial, each with its F32 `_scale_inv`; BF16 embeddings, norms and router;
// four per-expert experts; and an MTP module stored as one more layer. Then they
// check what a user relies on: the reference dequantization equals values
// computed by hand; the loader's tile-by-tile path equals the reference bit for
// bit, into fp32 and bf16 targets, into strided destinations and into a
// caller's own tensors (LoadOptions::destinations); a rank owning
// experts [2, 4) reads exactly the dense tensors plus its own experts' FP8 bytes
// and scales; a missing scale, a scale of the wrong shape, a scale of a
// non-FP8 weight and an orphan scale are reported by name before anything is
// read; and the MTP layer is skipped by name, its shard never opened.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/fp8.h"
#include "checkpoint/mapping_table.h"
#include "checkpoint/safetensors_index.h"
#include "checkpoint/tensor_io.h"
#include "checkpoint/weight_loader.h"
#include "tests/checkpoint/loader_test_util.h"

namespace moefit::checkpoint {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
using TensorMap = std::map<std::string, at::Tensor>;

constexpr int64_t kHidden = 200;  // 2 column blocks of 128: one full, one of 72
constexpr int64_t kQRank = 300;   // 3 row blocks: 128, 128, 44
constexpr int64_t kInter = 136;   // 2 blocks: 128, 8
constexpr int64_t kVocab = 10;
constexpr int64_t kNumExperts = 4;
constexpr std::array<int64_t, 2> kBlock = {128, 128};

const std::string kLayer = "model.layers.0.";
const std::string kMtp = "model.layers.1.";  // the MTP module after one decoder layer

std::string Expert(int64_t expert_idx, const std::string& proj) {
  return kLayer + "mlp.experts." + std::to_string(expert_idx) + "." + proj + ".weight";
}

// Random FP8 weight [rows, cols] and a positive scale per block.
std::pair<at::Tensor, at::Tensor> RandomFp8(int64_t rows, int64_t cols,
                                            std::array<int64_t, 2> block = kBlock) {
  // Inside E4M3's range (+-448; beyond it the conversion gives NaN).
  const at::Tensor weight = (at::randn({rows, cols}) * 50).clamp(-440, 440).to(at::kFloat8_e4m3fn);
  const std::vector<int64_t> grid = BlockScaleShape({rows, cols}, block);
  const at::Tensor scale = at::rand(grid) * 1e-3 + 1e-4;
  return {weight, scale};
}

void AddFp8(NamedTensors& shard, NamedTensors& scales, const std::string& name, int64_t rows,
            int64_t cols) {
  auto [weight, scale] = RandomFp8(rows, cols);
  shard.emplace_back(name, weight);
  scales.emplace_back(name + "_scale_inv", scale);
}

// The checkpoint, as shards: [0] weights, [1] every `_scale_inv` (so a weight and
// its scale sit in different files), [2] the MTP layer. `inter`: the experts'
// (and the shared expert's) intermediate size.
std::vector<NamedTensors> DeepseekShards(int64_t inter = kInter) {
  at::manual_seed(5);
  std::vector<NamedTensors> shards(3);
  NamedTensors& weights = shards[0];
  NamedTensors& scales = shards[1];
  weights.emplace_back("model.embed_tokens.weight", at::randn({kVocab, kHidden}).to(at::kBFloat16));
  weights.emplace_back("model.norm.weight", at::randn({kHidden}).to(at::kBFloat16));
  weights.emplace_back("lm_head.weight", at::randn({kVocab, kHidden}).to(at::kBFloat16));
  weights.emplace_back(kLayer + "input_layernorm.weight", at::randn({kHidden}).to(at::kBFloat16));
  AddFp8(weights, scales, kLayer + "self_attn.q_a_proj.weight", kQRank, kHidden);
  weights.emplace_back(kLayer + "mlp.gate.weight",
                       at::randn({kNumExperts, kHidden}).to(at::kBFloat16));
  weights.emplace_back(kLayer + "mlp.gate.e_score_correction_bias", at::randn({kNumExperts}));
  AddFp8(weights, scales, kLayer + "mlp.shared_experts.gate_proj.weight", inter, kHidden);
  for (int64_t e = 0; e < kNumExperts; ++e) {
    AddFp8(weights, scales, Expert(e, "gate_proj"), inter, kHidden);
    AddFp8(weights, scales, Expert(e, "up_proj"), inter, kHidden);
    AddFp8(weights, scales, Expert(e, "down_proj"), kHidden, inter);
  }
  // DeepSeek-V3's MTP module: its own projections and norms, plus a full layer.
  NamedTensors& mtp = shards[2];
  AddFp8(mtp, mtp, kMtp + "eh_proj.weight", kHidden, 2 * kHidden);
  mtp.emplace_back(kMtp + "enorm.weight", at::randn({kHidden}).to(at::kBFloat16));
  AddFp8(mtp, mtp, kMtp + "mlp.experts.0.gate_proj.weight", inter, kHidden);
  return shards;
}

const at::Tensor& Get(const std::vector<NamedTensors>& shards, const std::string& name) {
  for (const NamedTensors& shard : shards) {
    for (const auto& [n, t] : shard) {
      if (n == name) return t;
    }
  }
  ADD_FAILURE() << "no " << name;
  static const at::Tensor kNone;
  return kNone;
}

at::Tensor Reference(const std::vector<NamedTensors>& shards, const std::string& name,
                     at::ScalarType dtype) {
  absl::StatusOr<at::Tensor> out = DequantizeBlockFp8Reference(
      Get(shards, name), Get(shards, name + "_scale_inv"), kBlock, dtype);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : at::Tensor();
}

// What a rank owning experts 2 and 3 reads of the checkpoint's layer shards
// ([0] and [1]; not the MTP layer's): the dense tensors (FP8 weights with
// their scales) and its own experts' weights and scales. Bytes, tensors.
std::pair<uint64_t, int64_t> ReadByRankOfExperts23(const std::vector<NamedTensors>& shards) {
  uint64_t bytes = 0;
  int64_t tensors = 0;
  for (size_t shard_idx = 0; shard_idx < 2; ++shard_idx) {
    for (const auto& [name, t] : shards[shard_idx]) {
      const bool is_expert = name.find(".mlp.experts.") != std::string::npos;
      const bool mine = name.find(".experts.2.") != std::string::npos ||
                        name.find(".experts.3.") != std::string::npos;
      if (is_expert && !mine) continue;
      bytes += t.nbytes();
      ++tensors;
    }
  }
  return {bytes, tensors};
}

class Fp8LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("moefit_fp8_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes the shards plus an index.
  void Write(const std::vector<NamedTensors>& shards) {
    ShardedIndex index;
    for (size_t shard_idx = 0; shard_idx < shards.size(); ++shard_idx) {
      const std::string file = ShardFileName(shard_idx, shards.size());
      for (const auto& [name, t] : shards[shard_idx]) {
        index.weight_map[name] = file;
        index.total_size += t.nbytes();
      }
      ASSERT_TRUE(SaveTensors(dir_ / file, shards[shard_idx], {.sync = false}).ok());
    }
    ASSERT_TRUE(WriteShardedIndex(dir_ / std::string(kIndexFileName), index).ok());
  }

  // What the model expects: every runtime tensor of layer 0, in `dtype`.
  static std::map<std::string, ExpectedTensor> Expected(at::ScalarType dtype, int64_t num_experts) {
    return {
        {"model.embed_tokens.weight", {{kVocab, kHidden}, dtype}},
        {"model.norm.weight", {{kHidden}, dtype}},
        {"lm_head.weight", {{kVocab, kHidden}, dtype}},
        {kLayer + "input_layernorm.weight", {{kHidden}, dtype}},
        {kLayer + "self_attn.q_a_proj.weight", {{kQRank, kHidden}, dtype}},
        {kLayer + "mlp.gate.weight", {{kNumExperts, kHidden}, dtype}},
        {kLayer + "mlp.gate.e_score_correction_bias", {{kNumExperts}, at::kFloat}},
        {kLayer + "mlp.shared_experts.gate_proj.weight", {{kInter, kHidden}, dtype}},
        {kLayer + "mlp.experts.gate_up_proj", {{num_experts, 2 * kInter, kHidden}, dtype}},
        {kLayer + "mlp.experts.down_proj", {{num_experts, kHidden, kInter}, dtype}},
    };
  }

  std::filesystem::path dir_;
};

// Weight values that FP8 E4M3 holds exactly: multiples of 1/4 in [-2, 2].
double HandWeight(int64_t r, int64_t c) {
  return static_cast<double>((r * 7 + c * 3) % 17 - 8) / 4;
}
// Scales that are not powers of two, so the products round.
double HandScale(int64_t row_block, int64_t col_block) {
  return 0.0123 + 0.37 * static_cast<double>(row_block * 2 + col_block);
}

TEST(Fp8Test, ReferenceEqualsHandComputedValues) {
  std::vector<double> weight_values, scale_values;
  for (int64_t r = 0; r < kQRank; ++r) {
    for (int64_t c = 0; c < kHidden; ++c) weight_values.push_back(HandWeight(r, c));
  }
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t j = 0; j < 2; ++j) scale_values.push_back(HandScale(i, j));
  }
  const at::Tensor weight = at::tensor(weight_values, at::kDouble).reshape({kQRank, kHidden});
  const at::Tensor scale = at::tensor(scale_values, at::kDouble).reshape({3, 2}).to(at::kFloat);
  const at::Tensor fp8 = weight.to(at::kFloat8_e4m3fn);
  ASSERT_TRUE(at::equal(fp8.to(at::kDouble), weight));  // exactly representable
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    absl::StatusOr<at::Tensor> ref = DequantizeBlockFp8Reference(fp8, scale, kBlock, dtype);
    ASSERT_TRUE(ref.ok()) << ref.status();
    at::Tensor into = at::empty({kQRank, kHidden}, dtype);
    ASSERT_TRUE(DequantizeBlockFp8Into(into, fp8, scale, kBlock).ok());
    const at::Tensor ref_f = ref->to(at::kFloat);
    const at::Tensor into_f = into.to(at::kFloat);
    // Corners of full and partial blocks, and a sweep.
    std::vector<std::pair<int64_t, int64_t>> points = {{0, 0},   {127, 127}, {128, 128}, {255, 199},
                                                       {256, 0}, {299, 199}, {299, 128}, {130, 70}};
    for (int64_t r = 0; r < kQRank; r += 13) points.emplace_back(r, (r * 5) % kHidden);
    for (const auto& [r, c] : points) {
      // One fp32 product (exact in double, then rounded once), then the dtype.
      const float product = static_cast<float>(
          HandWeight(r, c) * static_cast<double>(static_cast<float>(HandScale(r / 128, c / 128))));
      const float want = dtype == at::kFloat ? product : static_cast<float>(c10::BFloat16(product));
      EXPECT_EQ(ref_f[r][c].item<float>(), want) << r << "," << c;
      EXPECT_EQ(into_f[r][c].item<float>(), want) << r << "," << c;
    }
    EXPECT_TRUE(SameBytes(into, *ref));
  }
}

TEST(Fp8Test, IntoStridedDestinationsEqualsReference) {
  at::manual_seed(1);
  for (const std::array<int64_t, 2> block :
       {kBlock, std::array<int64_t, 2>{64, 32}, std::array<int64_t, 2>{1, 200}}) {
    auto [weight, scale] = RandomFp8(kQRank, kHidden, block);
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
      SCOPED_TRACE(c10::toString(dtype));
      absl::StatusOr<at::Tensor> ref = DequantizeBlockFp8Reference(weight, scale, block, dtype);
      ASSERT_TRUE(ref.ok()) << ref.status();
      // Rows of a wider tensor (as one expert's gate rows in gate_up_proj) and a
      // transposed view.
      at::Tensor wide = at::zeros({2, kQRank + 4, kHidden}, dtype);
      at::Tensor rows = wide.select(0, 1).narrow(0, 4, kQRank);
      ASSERT_TRUE(DequantizeBlockFp8Into(rows, weight, scale, block).ok());
      EXPECT_TRUE(SameBytes(rows, *ref));
      EXPECT_EQ(wide.select(0, 0).count_nonzero().item<int64_t>(), 0);
      at::Tensor transposed = at::zeros({kHidden, kQRank}, dtype).t();
      ASSERT_TRUE(DequantizeBlockFp8Into(transposed, weight, scale, block).ok());
      EXPECT_TRUE(SameBytes(transposed, *ref));
    }
  }
}

TEST(Fp8Test, ShapeErrorsSayWhatDoesNotFit) {
  auto [weight, scale] = RandomFp8(kQRank, kHidden);
  at::Tensor out = at::empty({kQRank, kHidden});
  absl::Status bad_scale = DequantizeBlockFp8Into(out, weight, scale.narrow(1, 0, 1), kBlock);
  EXPECT_THAT(bad_scale.message(), HasSubstr("needs [3, 2]"));
  absl::Status bad_dst = DequantizeBlockFp8Into(out.narrow(0, 0, 10), weight, scale, kBlock);
  EXPECT_THAT(bad_dst.message(), HasSubstr("[10, 200]"));
  absl::Status not_fp8 = DequantizeBlockFp8Into(out, out, scale, kBlock);
  EXPECT_THAT(not_fp8.message(), HasSubstr("not FP8"));
}

TEST_F(Fp8LoaderTest, LoadsDequantizedIntoFp32AndBf16) {
  const std::vector<NamedTensors> shards = DeepseekShards();
  Write(shards);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    LoadReport report;
    LoadOptions options{.num_threads = 2, .expected = Expected(dtype, kNumExperts)};
    options.skip_layers_from = 1;
    absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_, "deepseek_v3", options, &report);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_TRUE(report.ok()) << report.ProblemSummary();
    EXPECT_THAT(report.unexpected, IsEmpty());

    EXPECT_TRUE(SameBytes(loaded->at(kLayer + "self_attn.q_a_proj.weight"),
                          Reference(shards, kLayer + "self_attn.q_a_proj.weight", dtype)));
    EXPECT_TRUE(
        SameBytes(loaded->at(kLayer + "mlp.shared_experts.gate_proj.weight"),
                  Reference(shards, kLayer + "mlp.shared_experts.gate_proj.weight", dtype)));
    const at::Tensor& gate_up = loaded->at(kLayer + "mlp.experts.gate_up_proj");
    const at::Tensor& down = loaded->at(kLayer + "mlp.experts.down_proj");
    for (int64_t e = 0; e < kNumExperts; ++e) {
      EXPECT_TRUE(SameBytes(gate_up[e], at::cat({Reference(shards, Expert(e, "gate_proj"), dtype),
                                                 Reference(shards, Expert(e, "up_proj"), dtype)})))
          << e;
      EXPECT_TRUE(SameBytes(down[e], Reference(shards, Expert(e, "down_proj"), dtype))) << e;
    }
    // Non-FP8 tensors are converted as before.
    EXPECT_TRUE(SameBytes(loaded->at("model.embed_tokens.weight"),
                          Get(shards, "model.embed_tokens.weight").to(dtype)));
    EXPECT_TRUE(SameBytes(loaded->at(kLayer + "mlp.gate.e_score_correction_bias"),
                          Get(shards, kLayer + "mlp.gate.e_score_correction_bias")));
    // The MTP layer is skipped by name, with its scales, and its shard never opened.
    EXPECT_THAT(report.skipped,
                ElementsAre(kMtp + "eh_proj.weight", kMtp + "eh_proj.weight_scale_inv",
                            kMtp + "enorm.weight", kMtp + "mlp.experts.0.gate_proj.weight",
                            kMtp + "mlp.experts.0.gate_proj.weight_scale_inv"));
    EXPECT_EQ(report.num_files_opened, 2);
  }
}

TEST_F(Fp8LoaderTest, WithoutExpectedDtypeFp8TargetsAreBf16) {
  const std::vector<NamedTensors> shards = DeepseekShards();
  Write(shards);
  LoadOptions options;
  options.skip_layers_from = 1;
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_, "deepseek_v3", options);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(SameBytes(loaded->at(kLayer + "self_attn.q_a_proj.weight"),
                        Reference(shards, kLayer + "self_attn.q_a_proj.weight", at::kBFloat16)));
  EXPECT_EQ(loaded->at(kLayer + "mlp.experts.down_proj").scalar_type(), at::kBFloat16);
  EXPECT_EQ(loaded->at(kLayer + "mlp.gate.e_score_correction_bias").scalar_type(), at::kFloat);
}

TEST_F(Fp8LoaderTest, RankReadsOnlyItsExpertsFp8BytesAndScales) {
  const std::vector<NamedTensors> shards = DeepseekShards();
  Write(shards);
  LoadOptions full_options{.expected = Expected(at::kFloat, kNumExperts)};
  full_options.skip_layers_from = 1;
  absl::StatusOr<TensorMap> full = LoadCheckpoint(dir_, "deepseek_v3", full_options);
  ASSERT_TRUE(full.ok()) << full.status();

  const auto [want_bytes, want_tensors] = ReadByRankOfExperts23(shards);
  LoadOptions options{
      .first_expert = 2, .num_experts = 2, .num_threads = 2, .expected = Expected(at::kFloat, 2)};
  options.skip_layers_from = 1;
  LoadReport report;
  absl::StatusOr<TensorMap> slice = LoadCheckpoint(dir_, "deepseek_v3", options, &report);
  ASSERT_TRUE(slice.ok()) << slice.status();
  EXPECT_EQ(report.num_bytes_read, want_bytes);
  EXPECT_EQ(report.num_tensors_read, want_tensors);
  for (const auto& [name, t] : *full) {
    const at::Tensor want = name.find(".mlp.experts.") != std::string::npos ? t.narrow(0, 2, 2) : t;
    EXPECT_TRUE(SameBytes(slice->at(name), want)) << name;
  }
}

TEST_F(Fp8LoaderTest, MissingScaleIsReportedByName) {
  std::vector<NamedTensors> shards = DeepseekShards();
  const std::string dropped = Expert(3, "up_proj") + "_scale_inv";
  std::erase_if(shards[1], [&](const auto& entry) { return entry.first == dropped; });
  Write(shards);
  LoadReport report;
  LoadOptions options{.expected = Expected(at::kBFloat16, kNumExperts)};
  options.skip_layers_from = 1;
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_, "deepseek_v3", options, &report);
  ASSERT_FALSE(loaded.ok());
  EXPECT_THAT(report.missing, ElementsAre(dropped));
  EXPECT_THAT(report.unexpected, IsEmpty());
  EXPECT_THAT(loaded.status().message(), HasSubstr(dropped));
  EXPECT_EQ(report.num_bytes_read, 0u);

  // A rank without expert 3 does not need that scale.
  LoadOptions low{.first_expert = 0, .num_experts = 2, .expected = Expected(at::kBFloat16, 2)};
  low.skip_layers_from = 1;
  EXPECT_TRUE(LoadCheckpoint(dir_, "deepseek_v3", low).ok());
}

TEST_F(Fp8LoaderTest, ScaleProblemsAreReportedByName) {
  std::vector<NamedTensors> shards = DeepseekShards();
  const std::string q = kLayer + "self_attn.q_a_proj.weight";
  for (auto& [name, t] : shards[1]) {
    if (name == q + "_scale_inv") t = t.narrow(1, 0, 1);  // [3, 1], needs [3, 2]
  }
  // A scale for a BF16 weight, and a scale of no weight at all.
  shards[1].emplace_back(kLayer + "input_layernorm.weight_scale_inv", at::ones({1}));
  shards[1].emplace_back(kLayer + "self_attn.nothing.weight_scale_inv", at::ones({1, 1}));
  Write(shards);
  LoadReport report;
  LoadOptions options{.expected = Expected(at::kFloat, kNumExperts)};
  options.skip_layers_from = 1;
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_, "deepseek_v3", options, &report);
  ASSERT_FALSE(loaded.ok());
  ASSERT_EQ(report.mismatched.size(), 2u);
  EXPECT_THAT(report.mismatched[0], HasSubstr(kLayer + "input_layernorm.weight_scale_inv"));
  EXPECT_THAT(report.mismatched[0], HasSubstr("not FP8"));
  EXPECT_THAT(report.mismatched[1], HasSubstr(q + "_scale_inv: checkpoint gives [3, 1]"));
  EXPECT_THAT(report.mismatched[1], HasSubstr("needs [3, 2]"));
  EXPECT_THAT(report.unexpected, ElementsAre(kLayer + "self_attn.nothing.weight_scale_inv"));
  EXPECT_THAT(loaded.status().message(), HasSubstr(q + "_scale_inv"));
  EXPECT_EQ(report.num_bytes_read, 0u);
}

TEST_F(Fp8LoaderTest, BlockSizeComesFromTheOptions) {
  at::manual_seed(2);
  const std::array<int64_t, 2> block = {64, 48};
  auto [weight, scale] = RandomFp8(kQRank, kHidden, block);  // scale [5, 5]
  const std::string name = kLayer + "self_attn.q_a_proj.weight";
  Write({NamedTensors{{name, weight}, {name + "_scale_inv", scale}}});
  // The default block does not fit this scale...
  LoadReport report;
  EXPECT_FALSE(LoadCheckpoint(dir_, "deepseek_v3", {}, &report).ok());
  ASSERT_EQ(report.mismatched.size(), 1u);
  EXPECT_THAT(report.mismatched[0], HasSubstr("in blocks of [128, 128] needs [3, 2]"));
  // ... the right one does.
  LoadOptions options{.expected = {{name, {{kQRank, kHidden}, at::kFloat}}}};
  options.fp8_block = block;
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_, "deepseek_v3", options);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  absl::StatusOr<at::Tensor> ref = DequantizeBlockFp8Reference(weight, scale, block, at::kFloat);
  ASSERT_TRUE(ref.ok());
  EXPECT_TRUE(SameBytes(loaded->at(name), *ref));
  options.fp8_block = {0, 128};
  EXPECT_FALSE(LoadCheckpoint(dir_, "deepseek_v3", options).ok());
}

TEST_F(Fp8LoaderTest, RulesWithoutAFusedPathWidenFp8First) {
  // A transposing rule goes through the reference ops, on the widened source.
  absl::StatusOr<MappingTable> table = TransposingTable();
  ASSERT_TRUE(table.ok()) << table.status();
  at::manual_seed(3);
  auto [weight, scale] = RandomFp8(kQRank, kHidden);
  Write({NamedTensors{{"w.weight", weight}, {"w.weight_scale_inv", scale}}});
  LoadOptions options{.expected = {{"w_t", {{kHidden, kQRank}, at::kBFloat16}}}};
  LoadReport report;
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_, *table, options, &report);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  absl::StatusOr<at::Tensor> ref =
      DequantizeBlockFp8Reference(weight, scale, kBlock, at::kBFloat16);
  ASSERT_TRUE(ref.ok());
  EXPECT_TRUE(SameBytes(loaded->at("w_t"), ref->t()));
  EXPECT_EQ(report.num_bytes_read, weight.nbytes() + scale.nbytes());
}

// FP8 sources widen straight into caller-given destinations, on the fused
// paths (a rank's experts, dense weights) and through the reference ops.
TEST_F(Fp8LoaderTest, DequantizesIntoDestinations) {
  const std::vector<NamedTensors> shards = DeepseekShards();
  Write(shards);
  LoadOptions full_options{.expected = Expected(at::kFloat, kNumExperts)};
  full_options.skip_layers_from = 1;
  absl::StatusOr<TensorMap> full = LoadCheckpoint(dir_, "deepseek_v3", full_options);
  ASSERT_TRUE(full.ok()) << full.status();

  LoadOptions options{
      .first_expert = 2, .num_experts = 2, .num_threads = 2, .expected = Expected(at::kFloat, 2)};
  options.skip_layers_from = 1;
  for (const auto& [name, e] : options.expected) {
    options.destinations[name] = at::full(e.shape, -7, at::TensorOptions().dtype(e.dtype));
  }
  absl::StatusOr<TensorMap> slice = LoadCheckpoint(dir_, "deepseek_v3", options);
  ASSERT_TRUE(slice.ok()) << slice.status();
  for (const auto& [name, dst] : options.destinations) {
    EXPECT_TRUE(slice->at(name).is_same(dst)) << name;
    const at::Tensor& t = full->at(name);
    EXPECT_TRUE(
        SameBytes(dst, name.find(".mlp.experts.") != std::string::npos ? t.narrow(0, 2, 2) : t))
        << name;
  }

  absl::StatusOr<MappingTable> table = TransposingTable();
  ASSERT_TRUE(table.ok()) << table.status();
  std::filesystem::remove_all(dir_);
  std::filesystem::create_directories(dir_);
  at::manual_seed(5);
  auto [weight, scale] = RandomFp8(kQRank, kHidden);
  Write({NamedTensors{{"w.weight", weight}, {"w.weight_scale_inv", scale}}});
  at::Tensor w_t = at::empty({kHidden, kQRank}, at::kBFloat16);
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(
      dir_, *table,
      {.expected = {{"w_t", {{kHidden, kQRank}, at::kBFloat16}}}, .destinations = {{"w_t", w_t}}});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(loaded->at("w_t").is_same(w_t));
  absl::StatusOr<at::Tensor> ref =
      DequantizeBlockFp8Reference(weight, scale, kBlock, at::kBFloat16);
  ASSERT_TRUE(ref.ok());
  EXPECT_TRUE(SameBytes(w_t, ref->t()));
}

TEST_F(Fp8LoaderTest, SkippedLayersAreNeverMatched) {
  // Without skip_layers_from the MTP keys are the table's business (here:
  // unexpected); with it they are skipped, whatever they are called.
  const std::vector<NamedTensors> shards = DeepseekShards();
  Write(shards);
  LoadReport report;
  EXPECT_FALSE(LoadCheckpoint(dir_, "deepseek_v3", {}, &report).ok());
  EXPECT_THAT(report.unexpected, ElementsAre(kMtp + "eh_proj.weight", kMtp + "enorm.weight"));
  EXPECT_THAT(report.skipped, IsEmpty());
  // From layer 0 on, only the tensors outside the layers are left.
  LoadOptions options;
  options.skip_layers_from = 0;
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_, "deepseek_v3", options, &report);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->size(), 3u);  // embed_tokens, norm, lm_head
  // Layer 0: 5 tensors and 2 scales outside the experts, 2 x 3 per expert; MTP: 5.
  EXPECT_EQ(report.skipped.size(), 7 + kNumExperts * 3 * 2 + 5u);
}

// A frozen base's experts kept in FP8: the model expects gate_up_proj and
// down_proj in float8_e4m3fn with their `_scale_inv` grids, and gets the
// checkpoint's bytes and scales as stored -- gate and up joined, this rank's
// experts only, each byte read once, straight into the caller's tensors.
TEST_F(Fp8LoaderTest, ExpertsKeptInFp8WithTheirScales) {
  constexpr int64_t kAligned = 256;  // gate and up fill whole 128-row blocks
  const std::vector<NamedTensors> shards = DeepseekShards(kAligned);
  Write(shards);
  const std::string gate_up = kLayer + "mlp.experts.gate_up_proj";
  const std::string down = kLayer + "mlp.experts.down_proj";
  std::map<std::string, ExpectedTensor> expected = Expected(at::kBFloat16, 2);
  expected[kLayer + "mlp.shared_experts.gate_proj.weight"].shape = {kAligned, kHidden};
  expected[gate_up] = {{2, 2 * kAligned, kHidden}, at::kFloat8_e4m3fn};
  expected[down] = {{2, kHidden, kAligned}, at::kFloat8_e4m3fn};
  expected[gate_up + "_scale_inv"] = {{2, 4, 2}, at::kFloat};
  expected[down + "_scale_inv"] = {{2, 2, 2}, at::kFloat};
  LoadOptions options{.first_expert = 2, .num_experts = 2, .num_threads = 2, .expected = expected};
  options.skip_layers_from = 1;
  const at::Tensor gate_up_dst = at::empty({2, 2 * kAligned, kHidden}, at::kFloat8_e4m3fn);
  const at::Tensor scale_dst = at::empty({2, 4, 2});
  options.destinations = {{gate_up, gate_up_dst}, {gate_up + "_scale_inv", scale_dst}};
  LoadReport report;
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_, "deepseek_v3", options, &report);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(report.ok()) << report.ProblemSummary();
  EXPECT_TRUE(loaded->at(gate_up).is_same(gate_up_dst));
  EXPECT_TRUE(loaded->at(gate_up + "_scale_inv").is_same(scale_dst));
  for (int64_t e = 0; e < 2; ++e) {
    SCOPED_TRACE(e);
    const std::string gate = Expert(2 + e, "gate_proj"), up = Expert(2 + e, "up_proj");
    const std::string d = Expert(2 + e, "down_proj");
    EXPECT_TRUE(SameBytes(gate_up_dst[e], at::cat({Get(shards, gate), Get(shards, up)})));
    EXPECT_TRUE(SameBytes(
        scale_dst[e], at::cat({Get(shards, gate + "_scale_inv"), Get(shards, up + "_scale_inv")})));
    EXPECT_TRUE(SameBytes(loaded->at(down)[e], Get(shards, d)));
    EXPECT_TRUE(SameBytes(loaded->at(down + "_scale_inv")[e], Get(shards, d + "_scale_inv")));
  }
  // Dense FP8 weights are still widened to the dtype the model names.
  EXPECT_TRUE(SameBytes(loaded->at(kLayer + "self_attn.q_a_proj.weight"),
                        Reference(shards, kLayer + "self_attn.q_a_proj.weight", at::kBFloat16)));
  // Every byte once: the dense tensors and their scales, this rank's experts' bytes and scales.
  EXPECT_EQ(report.num_bytes_read, ReadByRankOfExperts23(shards).first);
}

// ExpertsStoredAsFp8 reads the experts' stored dtype as the loader finds the
// files: through the index, or from the headers of shards without one; and
// says false once the experts are stored in another dtype.
TEST_F(Fp8LoaderTest, ExpertsStoredAsFp8ReadsTheStoredExperts) {
  std::vector<NamedTensors> shards = DeepseekShards();
  Write(shards);
  absl::StatusOr<bool> fp8 = ExpertsStoredAsFp8(dir_, "deepseek_v3");
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  EXPECT_TRUE(*fp8);
  std::filesystem::remove(dir_ / std::string(kIndexFileName));
  fp8 = ExpertsStoredAsFp8(dir_, "deepseek_v3");
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  EXPECT_TRUE(*fp8);
  // The experts dequantized to bfloat16 (their scales dropped), the rest as stored.
  std::vector<NamedTensors> converted(2);
  for (size_t shard_idx = 0; shard_idx < 2; ++shard_idx) {
    for (const auto& [name, t] : shards[shard_idx]) {
      if (name.find(".mlp.experts.") == std::string::npos) {
        converted[shard_idx].emplace_back(name, t);
      } else if (!name.ends_with("_scale_inv")) {
        converted[shard_idx].emplace_back(name, Reference(shards, name, at::kBFloat16));
      }
    }
  }
  std::filesystem::remove_all(dir_);
  std::filesystem::create_directories(dir_);
  Write(converted);
  fp8 = ExpertsStoredAsFp8(dir_, "deepseek_v3");
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  EXPECT_FALSE(*fp8);
}

// What cannot be kept in FP8 is named before anything is read: a source
// stored in another dtype, gate/up halves whose scale blocks straddle the
// join, an FP8 target whose scales the caller does not take, and scales
// asked of a target that is not kept in FP8.
TEST_F(Fp8LoaderTest, WhatCannotBeKeptInFp8IsNamed) {
  Write(DeepseekShards());  // intermediate size 136: gate ends inside a block
  std::map<std::string, ExpectedTensor> expected = Expected(at::kBFloat16, kNumExperts);
  const std::string gate_up = kLayer + "mlp.experts.gate_up_proj";
  expected[gate_up].dtype = at::kFloat8_e4m3fn;
  expected[gate_up + "_scale_inv"] = {{kNumExperts, 3, 2}, at::kFloat};
  expected["model.embed_tokens.weight"].dtype = at::kFloat8_e4m3fn;
  expected[kLayer + "mlp.experts.down_proj"].dtype = at::kFloat8_e4m3fn;  // no scales expected
  expected["model.norm.weight_scale_inv"] = {{1}, at::kFloat};
  LoadOptions options{.expected = expected};
  options.skip_layers_from = 1;
  LoadReport report;
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_, "deepseek_v3", options, &report);
  ASSERT_FALSE(loaded.ok());
  EXPECT_THAT(report.missing, IsEmpty());
  EXPECT_THAT(report.unexpected, IsEmpty());
  EXPECT_THAT(report.mismatched,
              ElementsAre(HasSubstr("model.embed_tokens.weight: stored as BF16, but "
                                    "model.embed_tokens.weight is kept in Float8_e4m3fn"),
                          HasSubstr(kLayer +
                                    "mlp.experts.down_proj: kept in Float8_e4m3fn, which "
                                    "is read with its scales; expect " +
                                    kLayer + "mlp.experts.down_proj_scale_inv too"),
                          HasSubstr(gate_up + ": kept in Float8_e4m3fn, its part " +
                                    Expert(0, "gate_proj") +
                                    " [136, 200] does not fill whole "
                                    "blocks of [128, 128] along dim 0"),
                          HasSubstr("model.norm.weight_scale_inv: a scale grid is loaded only "
                                    "beside a target expected in an FP8 dtype, and "
                                    "model.norm.weight is not")));
  EXPECT_THAT(loaded.status().message(), HasSubstr("does not fill whole blocks"));
}

// The quantizer that makes FP8 experts where no checkpoint gives them is the
// dequantizer's inverse up to FP8's rounding: each block's largest magnitude
// becomes 448 exactly, and every value comes back within half an FP8 step.
TEST(Fp8Test, QuantizeRoundTripsWithinFp8Precision) {
  at::manual_seed(3);
  const at::Tensor w = at::randn({3, 200, 136}) * 0.02;
  w[1].narrow(0, 128, 72).narrow(1, 0, 128).zero_();  // an all-zero block keeps scale 1
  absl::StatusOr<std::pair<at::Tensor, at::Tensor>> q = QuantizeBlockFp8(w, kBlock);
  ASSERT_TRUE(q.ok()) << q.status();
  const auto& [fp8, scale] = *q;
  EXPECT_EQ(fp8.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_EQ(scale.sizes(), at::IntArrayRef({3, 2, 2}));
  EXPECT_EQ(scale[1][1][0].item<float>(), 1.0f);
  for (int64_t e = 0; e < 3; ++e) {
    absl::StatusOr<at::Tensor> back =
        DequantizeBlockFp8Reference(fp8[e], scale[e], kBlock, at::kFloat);
    ASSERT_TRUE(back.ok()) << back.status();
    const at::Tensor full =
        scale[e].repeat_interleave(128, 0).repeat_interleave(128, 1).narrow(0, 0, 200).narrow(1, 0,
                                                                                              136);
    // E4M3 keeps 3 mantissa bits: a relative step of 2^-3, half of it at most
    // lost, and below the normal range (2^-6 of the scale) a fixed step of 2^-9.
    const at::Tensor bound = at::maximum(w[e].abs() * (1.0 / 16), full * (1.0 / 1024)) + 1e-12;
    EXPECT_TRUE(((*back - w[e]).abs() <= bound).all().item<bool>()) << e;
    EXPECT_NEAR((fp8[e].to(at::kFloat).abs().amax()).item<float>(), 448.0f, 0.0f);
  }
  EXPECT_FALSE(QuantizeBlockFp8(at::zeros({4}), kBlock).ok());
  EXPECT_FALSE(QuantizeBlockFp8(fp8, kBlock).ok());
}

}  // namespace
}  // namespace moefit::checkpoint
