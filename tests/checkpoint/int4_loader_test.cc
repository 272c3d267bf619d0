// compressed-tensors checkpoints, end to end: pack-quantized int4 and the
// float-quantized FP8 block variant.
//
// The tests write a tiny Kimi-K2-Thinking-style checkpoint (deepseek_v3
// family): BF16 embeddings, norms, attention and router; the shared expert and
// four routed experts pack-quantized int4 (`X.weight_packed`, `X.weight_scale`,
// `X.weight_shape`, and `X.weight_zero_point` when asymmetric), every scale in
// a file of its own so a weight and its companions sit in different shards.
// The nibbles are packed here, one at a time, as the format describes, and the
// reference values are the library's arithmetic in plain torch ops:
// ((q - z) in the scale's dtype * scale, then the target's dtype). Then they
// check what a user relies on: dequantized targets equal the reference bit for
// bit (fp32 and bf16; symmetric and asymmetric; groups of 32, 128 and 12, rows
// of a width that is not a multiple of 8, a last group cut short); targets kept
// packed equal the stored bytes, scales and zero points; a rank owning experts
// [2, 4) reads the dense tensors and only its own experts' words and
// companions; each kind of bad companion, scale dtype or rule is named before
// any weight is read. The FP8 variant (`X.weight_scale`) loads as DeepSeek's
// `X.weight_scale_inv` does.
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

#include "checkpoint/compressed_tensors.h"
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
using ::testing::UnorderedElementsAre;
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
using TensorMap = std::map<std::string, at::Tensor>;

constexpr int64_t kVocab = 10;
constexpr int64_t kNumExperts = 4;
const std::string kLayer = "model.layers.0.";

std::string Expert(int64_t expert_idx, const std::string& proj) {
  return kLayer + "mlp.experts." + std::to_string(expert_idx) + "." + proj + ".weight";
}
const std::string kShared = kLayer + "mlp.shared_experts.gate_proj.weight";
const std::string kGateUp = kLayer + "mlp.experts.gate_up_proj";
const std::string kDown = kLayer + "mlp.experts.down_proj";

// One quantized Linear as the test made it, before packing.
struct Int4Linear {
  at::Tensor q;      // int8 [rows, cols], in [-8, 7]
  at::Tensor scale;  // [rows, groups]
  at::Tensor zero;   // int8 [rows, groups], in [-8, 7]; undefined when symmetric
};

// Packs values in [-8, 7] (int8 [rows, cols]) along `packed_dim`, eight per
// int32: value i of a run sits in bits [4i, 4i + 4) as value + 8.
at::Tensor PackNibbles(const at::Tensor& values, int64_t packed_dim) {
  const at::Tensor v = packed_dim == 0 ? values.t().contiguous() : values.contiguous();
  const int64_t rows = v.size(0), cols = v.size(1);
  const int64_t words = (cols + 7) / 8;
  std::vector<uint32_t> packed(static_cast<size_t>(rows * words), 0);
  const auto acc = v.accessor<int8_t, 2>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t nibble = static_cast<uint32_t>(acc[r][c] + 8);
      packed[r * words + c / 8] |= nibble << (4 * (c % 8));
    }
  }
  at::Tensor out = at::empty({rows, words}, at::kInt);
  std::memcpy(out.data_ptr(), packed.data(), packed.size() * sizeof(uint32_t));
  return packed_dim == 0 ? out.t().contiguous() : out;
}

// compressed-tensors' decompression in plain torch ops: the scales and zero
// points widened to each column of their group, (q - z) in the scale's dtype,
// times the scale (rounded to the scale's dtype), then `dtype`.
at::Tensor Reference(const Int4Linear& w, int64_t group_size, at::ScalarType dtype) {
  const int64_t cols = w.q.size(1);
  auto widen = [&](const at::Tensor& t) {
    return t.repeat_interleave(group_size, 1).narrow(1, 0, cols);
  };
  at::Tensor x = w.q.to(w.scale.scalar_type());
  if (w.zero.defined()) x = x - widen(w.zero).to(w.scale.scalar_type());
  return (x * widen(w.scale)).to(dtype);
}

struct Scheme {
  int64_t group_size;
  bool symmetric;
  int64_t hidden;  // the experts' input width (gate, up) and output width (down)
  int64_t inter;   // the experts' and the shared expert's intermediate size
  at::ScalarType scale_dtype = at::kBFloat16;

  PackedInt4Format format() const { return {.group_size = group_size, .symmetric = symmetric}; }
};

std::string Describe(const Scheme& s) {
  return "group" + std::to_string(s.group_size) + (s.symmetric ? "_sym" : "_asym") + "_h" +
         std::to_string(s.hidden) + "_i" + std::to_string(s.inter) + "_" +
         (s.scale_dtype == at::kBFloat16 ? "bf16" : "f32");
}
std::string SchemeName(const ::testing::TestParamInfo<Scheme>& info) {
  return Describe(info.param);
}
void PrintTo(const Scheme& s, std::ostream* out) { *out << Describe(s); }

// The checkpoint: [0] weights (BF16, and the int4 words), [1] every int4
// scale, [2] every shape and zero point.
class Int4Checkpoint {
 public:
  Int4Checkpoint(const Scheme& scheme, uint64_t seed) : scheme_(scheme), shards_(3) {
    at::manual_seed(seed);
    const int64_t h = scheme.hidden, i = scheme.inter;
    Dense("model.embed_tokens.weight", {kVocab, h});
    Dense("model.norm.weight", {h});
    Dense("lm_head.weight", {kVocab, h});
    Dense(kLayer + "input_layernorm.weight", {h});
    Dense(kLayer + "self_attn.q_a_proj.weight", {24, h});
    Dense(kLayer + "mlp.gate.weight", {kNumExperts, h});
    shards_[0].emplace_back(kLayer + "mlp.gate.e_score_correction_bias", at::randn({kNumExperts}));
    Quantized(kShared, i, h);
    for (int64_t e = 0; e < kNumExperts; ++e) {
      Quantized(Expert(e, "gate_proj"), i, h);
      Quantized(Expert(e, "up_proj"), i, h);
      Quantized(Expert(e, "down_proj"), h, i);
    }
  }

  const std::vector<NamedTensors>& shards() const { return shards_; }
  std::vector<NamedTensors>& shards() { return shards_; }
  const Int4Linear& linear(const std::string& name) const { return linears_.at(name); }
  const at::Tensor& stored(const std::string& name) const {
    for (const NamedTensors& shard : shards_) {
      for (const auto& [n, t] : shard) {
        if (n == name) return t;
      }
    }
    ADD_FAILURE() << "no " << name;
    static const at::Tensor kNone;
    return kNone;
  }
  at::Tensor Ref(const std::string& name, at::ScalarType dtype) const {
    return Reference(linear(name), scheme_.group_size, dtype);
  }

  // Drops the on-disk tensor `name`.
  void Drop(const std::string& name) {
    for (NamedTensors& shard : shards_) {
      std::erase_if(shard, [&](const auto& entry) { return entry.first == name; });
    }
  }
  // Replaces the on-disk tensor `name`.
  void Replace(const std::string& name, at::Tensor t) {
    for (NamedTensors& shard : shards_) {
      for (auto& [n, stored] : shard) {
        if (n == name) stored = t;
      }
    }
  }

 private:
  void Dense(const std::string& name, std::vector<int64_t> shape) {
    shards_[0].emplace_back(name, at::randn(shape).to(at::kBFloat16));
  }

  void Quantized(const std::string& name, int64_t rows, int64_t cols) {
    const int64_t groups = NumInt4Groups(cols, scheme_.group_size);
    Int4Linear w;
    w.q = at::randint(-8, 8, {rows, cols}, at::kChar);
    w.scale = (at::rand({rows, groups}) * 0.01 + 1e-3).to(scheme_.scale_dtype);
    shards_[0].emplace_back(name + "_packed", PackNibbles(w.q, 1));
    shards_[1].emplace_back(name + "_scale", w.scale);
    shards_[2].emplace_back(name + "_shape", at::tensor({rows, cols}, at::kLong));
    if (!scheme_.symmetric) {
      w.zero = at::randint(-8, 8, {rows, groups}, at::kChar);
      shards_[2].emplace_back(name + "_zero_point", PackNibbles(w.zero, 0));
    }
    linears_.emplace(name, std::move(w));
  }

  Scheme scheme_;
  std::vector<NamedTensors> shards_;
  std::map<std::string, Int4Linear> linears_;
};

class Int4LoaderTest : public ::testing::TestWithParam<Scheme> {
 protected:
  void SetUp() override {
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ = std::filesystem::path(::testing::TempDir()) / ("moefit_int4_" + name);
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes the shards plus an index.
  void Write(const std::vector<NamedTensors>& shards) {
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
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

  // Every runtime tensor of layer 0 in `dtype`, the experts in `expert_dtype`
  // (uint8: kept packed, with their scales and, asymmetric, zero points).
  std::map<std::string, ExpectedTensor> Expected(at::ScalarType dtype, at::ScalarType expert_dtype,
                                                 int64_t num_experts) const {
    const Scheme& s = GetParam();
    const int64_t h = s.hidden, i = s.inter;
    std::map<std::string, ExpectedTensor> expected = {
        {"model.embed_tokens.weight", {{kVocab, h}, dtype}},
        {"model.norm.weight", {{h}, dtype}},
        {"lm_head.weight", {{kVocab, h}, dtype}},
        {kLayer + "input_layernorm.weight", {{h}, dtype}},
        {kLayer + "self_attn.q_a_proj.weight", {{24, h}, dtype}},
        {kLayer + "mlp.gate.weight", {{kNumExperts, h}, dtype}},
        {kLayer + "mlp.gate.e_score_correction_bias", {{kNumExperts}, at::kFloat}},
        {kShared, {{i, h}, dtype}},
    };
    if (expert_dtype != at::kByte) {
      expected[kGateUp] = {{num_experts, 2 * i, h}, expert_dtype};
      expected[kDown] = {{num_experts, h, i}, expert_dtype};
      return expected;
    }
    expected[kGateUp] = {{num_experts, 2 * i, PackedInt4Words(h) * 4}, at::kByte};
    expected[kDown] = {{num_experts, h, PackedInt4Words(i) * 4}, at::kByte};
    const int64_t gate_up_groups = NumInt4Groups(h, s.group_size);
    const int64_t down_groups = NumInt4Groups(i, s.group_size);
    expected[kGateUp + "_scale"] = {{num_experts, 2 * i, gate_up_groups}, at::kBFloat16};
    expected[kDown + "_scale"] = {{num_experts, h, down_groups}, at::kBFloat16};
    if (!s.symmetric) {
      expected[kGateUp + "_zero_point"] = {{num_experts, 2 * i, gate_up_groups}, at::kChar};
      expected[kDown + "_zero_point"] = {{num_experts, h, down_groups}, at::kChar};
    }
    return expected;
  }

  LoadOptions Options(std::map<std::string, ExpectedTensor> expected) const {
    LoadOptions options{.num_threads = 2, .expected = std::move(expected)};
    options.int4 = GetParam().format();
    return options;
  }

  std::filesystem::path dir_;
};

// What a rank owning experts 2 and 3 reads: every tensor outside the routed
// experts (the shared expert's int4 words with its companions), and its own
// experts' words, scales, shapes and zero points. Bytes, tensors.
std::pair<uint64_t, int64_t> ReadByRankOfExperts23(const std::vector<NamedTensors>& shards) {
  uint64_t bytes = 0;
  int64_t tensors = 0;
  for (const NamedTensors& shard : shards) {
    for (const auto& [name, t] : shard) {
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

// Bytes of the on-disk tensors whose names satisfy `pred`.
template <typename Pred>
uint64_t BytesOf(const std::vector<NamedTensors>& shards, Pred pred) {
  uint64_t bytes = 0;
  for (const NamedTensors& shard : shards) {
    for (const auto& [name, t] : shard) {
      if (pred(name)) bytes += t.nbytes();
    }
  }
  return bytes;
}

TEST_P(Int4LoaderTest, DequantizesBitForBitIntoFp32AndBf16) {
  const Int4Checkpoint ckpt(GetParam(), 1);
  Write(ckpt.shards());
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    LoadReport report;
    absl::StatusOr<TensorMap> loaded =
        LoadCheckpoint(dir_, "deepseek_v3", Options(Expected(dtype, dtype, kNumExperts)), &report);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_TRUE(report.ok()) << report.ProblemSummary();
    EXPECT_TRUE(SameBytes(loaded->at(kShared), ckpt.Ref(kShared, dtype)));
    for (int64_t e = 0; e < kNumExperts; ++e) {
      SCOPED_TRACE(e);
      EXPECT_TRUE(
          SameBytes(loaded->at(kGateUp)[e], at::cat({ckpt.Ref(Expert(e, "gate_proj"), dtype),
                                                     ckpt.Ref(Expert(e, "up_proj"), dtype)})));
      EXPECT_TRUE(SameBytes(loaded->at(kDown)[e], ckpt.Ref(Expert(e, "down_proj"), dtype)));
    }
    // Unquantized tensors are converted as before.
    EXPECT_TRUE(SameBytes(loaded->at("model.embed_tokens.weight"),
                          ckpt.stored("model.embed_tokens.weight").to(dtype)));
    // Every byte once: words, scales, shapes and zero points included.
    EXPECT_EQ(report.num_bytes_read,
              BytesOf(ckpt.shards(), [](const std::string&) { return true; }));
  }
}

TEST_P(Int4LoaderTest, KeptPackedTargetsHoldTheStoredBytesScalesAndZeroPoints) {
  const Int4Checkpoint ckpt(GetParam(), 2);
  Write(ckpt.shards());
  LoadOptions options = Options(Expected(at::kBFloat16, at::kByte, 2));
  options.first_expert = 2;
  options.num_experts = 2;
  // Into the caller's tensors, as a model's parameters.
  for (const std::string& name : {kGateUp, kGateUp + "_scale", kDown}) {
    const ExpectedTensor& e = options.expected.at(name);
    options.destinations[name] = at::zeros(e.shape, at::TensorOptions().dtype(e.dtype));
  }
  LoadReport report;
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_, "deepseek_v3", options, &report);
  if (GetParam().scale_dtype != at::kBFloat16) {
    // The kernels take the scales as stored, which they read as BF16.
    ASSERT_FALSE(loaded.ok());
    EXPECT_THAT(loaded.status().message(),
                HasSubstr(Expert(2, "down_proj") + "_scale: F32 scales, but " + kDown));
    return;
  }
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(report.ok()) << report.ProblemSummary();
  EXPECT_TRUE(loaded->at(kGateUp).is_same(options.destinations.at(kGateUp)));
  auto bytes_of = [](const at::Tensor& packed) { return packed.view(at::kByte); };
  for (int64_t e = 0; e < 2; ++e) {
    SCOPED_TRACE(e);
    const std::string gate = Expert(2 + e, "gate_proj"), up = Expert(2 + e, "up_proj");
    const std::string down = Expert(2 + e, "down_proj");
    EXPECT_TRUE(SameBytes(
        loaded->at(kGateUp)[e],
        at::cat({bytes_of(ckpt.stored(gate + "_packed")), bytes_of(ckpt.stored(up + "_packed"))})));
    EXPECT_TRUE(SameBytes(loaded->at(kDown)[e], bytes_of(ckpt.stored(down + "_packed"))));
    EXPECT_TRUE(SameBytes(loaded->at(kGateUp + "_scale")[e],
                          at::cat({ckpt.stored(gate + "_scale"), ckpt.stored(up + "_scale")})));
    EXPECT_TRUE(SameBytes(loaded->at(kDown + "_scale")[e], ckpt.stored(down + "_scale")));
    if (!GetParam().symmetric) {
      EXPECT_TRUE(SameBytes(loaded->at(kGateUp + "_zero_point")[e],
                            at::cat({ckpt.linear(gate).zero, ckpt.linear(up).zero})));
      EXPECT_TRUE(SameBytes(loaded->at(kDown + "_zero_point")[e], ckpt.linear(down).zero));
    }
    // The kept layout is the one the header describes: nibble c of a row, low
    // first, is q + 8.
    const at::Tensor row = loaded->at(kDown)[e][3];
    const at::Tensor q = ckpt.linear(down).q[3];
    for (int64_t c = 0; c < q.size(0); ++c) {
      const int nibble = (row[c / 2].item<uint8_t>() >> (4 * (c % 2))) & 0xF;
      ASSERT_EQ(nibble - 8, q[c].item<int8_t>()) << c;
    }
  }
  // The shared expert, not kept, is dequantized beside them.
  EXPECT_TRUE(SameBytes(loaded->at(kShared), ckpt.Ref(kShared, at::kBFloat16)));
  // Each byte once, this rank's experts only.
  EXPECT_EQ(report.num_bytes_read, ReadByRankOfExperts23(ckpt.shards()).first);
  EXPECT_EQ(report.num_tensors_read, ReadByRankOfExperts23(ckpt.shards()).second);
}

TEST_P(Int4LoaderTest, RankReadsOnlyItsExpertsWordsAndCompanions) {
  const Int4Checkpoint ckpt(GetParam(), 3);
  Write(ckpt.shards());
  absl::StatusOr<TensorMap> full =
      LoadCheckpoint(dir_, "deepseek_v3", Options(Expected(at::kFloat, at::kFloat, kNumExperts)));
  ASSERT_TRUE(full.ok()) << full.status();
  LoadOptions options = Options(Expected(at::kFloat, at::kFloat, 2));
  options.first_expert = 2;
  options.num_experts = 2;
  LoadReport report;
  absl::StatusOr<TensorMap> slice = LoadCheckpoint(dir_, "deepseek_v3", options, &report);
  ASSERT_TRUE(slice.ok()) << slice.status();
  const auto [want_bytes, want_tensors] = ReadByRankOfExperts23(ckpt.shards());
  EXPECT_EQ(report.num_bytes_read, want_bytes);
  EXPECT_EQ(report.num_tensors_read, want_tensors);
  for (const auto& [name, t] : *full) {
    const at::Tensor want = name.find(".mlp.experts.") != std::string::npos ? t.narrow(0, 2, 2) : t;
    EXPECT_TRUE(SameBytes(slice->at(name), want)) << name;
  }
}

TEST_P(Int4LoaderTest, WithoutExpectedDtypeInt4TargetsAreDequantizedDtype) {
  const Int4Checkpoint ckpt(GetParam(), 4);
  Write(ckpt.shards());
  LoadOptions options;
  options.int4 = GetParam().format();
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_, "deepseek_v3", options);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(SameBytes(loaded->at(kShared), ckpt.Ref(kShared, at::kBFloat16)));
  EXPECT_TRUE(SameBytes(loaded->at(kDown)[1], ckpt.Ref(Expert(1, "down_proj"), at::kBFloat16)));
  EXPECT_EQ(loaded->at(kLayer + "mlp.gate.e_score_correction_bias").scalar_type(), at::kFloat);
  // No companion becomes a tensor of its own.
  for (const auto& [name, t] : *loaded) {
    EXPECT_FALSE(name.ends_with("_scale") || name.ends_with("_shape") ||
                 name.ends_with("_zero_point") || name.ends_with("_packed"))
        << name;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Schemes, Int4LoaderTest,
    ::testing::Values(
        // Kimi-K2-Thinking's scheme; down_proj's 96 columns leave 128's one group short.
        Scheme{.group_size = 32, .symmetric = true, .hidden = 256, .inter = 96},
        Scheme{.group_size = 128, .symmetric = true, .hidden = 256, .inter = 96},
        Scheme{.group_size = 32, .symmetric = false, .hidden = 256, .inter = 96},
        // Rows of 60 and 36 values: words and zero-point words not filled.
        Scheme{.group_size = 12, .symmetric = false, .hidden = 60, .inter = 36},
        Scheme{.group_size = 128,
               .symmetric = false,
               .hidden = 256,
               .inter = 100,
               .scale_dtype = at::kFloat}),
    SchemeName);

// The fixture's scheme for the tests of one case.
class Int4ProblemsTest : public Int4LoaderTest {};

// Every companion problem is named, before any weight is read.
TEST_P(Int4ProblemsTest, CompanionProblemsAreNamed) {
  Int4Checkpoint ckpt(GetParam(), 5);
  const std::string up3 = Expert(3, "up_proj"), down1 = Expert(1, "down_proj");
  ckpt.Drop(up3 + "_scale");
  ckpt.Drop(Expert(2, "gate_proj") + "_shape");
  ckpt.Drop(Expert(0, "gate_proj") + "_zero_point");
  ckpt.Replace(down1 + "_scale", ckpt.stored(down1 + "_scale").narrow(1, 0, 1));
  ckpt.Replace(kShared + "_shape", at::tensor({96, 248}, at::kLong));  // 32 words hold 249 .. 256
  ckpt.Replace(Expert(1, "up_proj") + "_zero_point",
               ckpt.stored(Expert(1, "up_proj") + "_zero_point").narrow(0, 0, 11));
  ckpt.shards()[2].emplace_back(kLayer + "self_attn.nothing.weight_shape",
                                at::tensor({1, 1}, at::kLong));
  Write(ckpt.shards());
  LoadReport report;
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(
      dir_, "deepseek_v3", Options(Expected(at::kFloat, at::kFloat, kNumExperts)), &report);
  ASSERT_FALSE(loaded.ok());
  EXPECT_THAT(report.missing, ElementsAre(Expert(0, "gate_proj") + "_zero_point",
                                          Expert(2, "gate_proj") + "_shape", up3 + "_scale"));
  EXPECT_THAT(report.unexpected, ElementsAre(kLayer + "self_attn.nothing.weight_shape"));
  ASSERT_EQ(report.mismatched.size(), 3u) << report.ProblemSummary();
  EXPECT_THAT(report.mismatched[0],
              HasSubstr(down1 + "_scale: checkpoint gives [256, 1], int4 weight " + down1 +
                        "_packed of [256, 96] in groups of 32 needs [256, 3]"));
  EXPECT_THAT(report.mismatched[1],
              HasSubstr(Expert(1, "up_proj") + "_zero_point: checkpoint gives I32 [11, 8]"));
  EXPECT_THAT(report.mismatched[1], HasSubstr("needs I32 [12, 8]"));
  EXPECT_THAT(report.mismatched[2], HasSubstr(kShared + "_shape: [96, 248] does not fit " +
                                              kShared + "_packed [96, 32]"));
  EXPECT_THAT(loaded.status().message(), HasSubstr(up3 + "_scale"));
  // Only the shapes were read (those of the weights, not the orphan's).
  EXPECT_EQ(report.num_bytes_read, BytesOf(ckpt.shards(), [](const std::string& name) {
              return name.ends_with("_shape") && name.find("nothing") == std::string::npos;
            }));
}

// A symmetric scheme has no zero points; one in the files is unexpected, and
// packed weights without LoadOptions::int4 match nothing.
TEST_P(Int4ProblemsTest, ZeroPointsOfASymmetricSchemeAndPackedWeightsWithoutInt4) {
  Int4Checkpoint ckpt(GetParam(), 6);
  Write(ckpt.shards());
  LoadOptions options = Options(Expected(at::kFloat, at::kFloat, kNumExperts));
  options.int4->symmetric = true;
  LoadReport report;
  EXPECT_FALSE(LoadCheckpoint(dir_, "deepseek_v3", options, &report).ok());
  EXPECT_EQ(report.unexpected.size(), 1u + 3 * kNumExperts);
  EXPECT_THAT(report.unexpected[0], HasSubstr("_zero_point"));
  EXPECT_THAT(report.missing, IsEmpty());

  options.int4.reset();
  EXPECT_FALSE(LoadCheckpoint(dir_, "deepseek_v3", options, &report).ok());
  EXPECT_THAT(report.unexpected, ::testing::Contains(kShared + "_packed"));
  EXPECT_THAT(report.missing, ::testing::Contains(kShared));
}

// What cannot be kept packed is named: scales that are not BF16, a rule that
// is not the routed experts', a kept target whose companions are not expected,
// and companions asked of a target that is not kept.
TEST_P(Int4ProblemsTest, WhatCannotBeKeptPackedIsNamed) {
  Int4Checkpoint ckpt(GetParam(), 7);
  const std::string down2 = Expert(2, "down_proj");
  ckpt.Replace(down2 + "_scale", ckpt.stored(down2 + "_scale").to(at::kFloat));
  Write(ckpt.shards());
  std::map<std::string, ExpectedTensor> expected = Expected(at::kFloat, at::kByte, kNumExperts);
  expected[kShared] = {{96, 128}, at::kByte};
  expected.erase(kGateUp + "_zero_point");
  expected["model.norm.weight_scale"] = {{1}, at::kBFloat16};
  LoadReport report;
  absl::StatusOr<TensorMap> loaded =
      LoadCheckpoint(dir_, "deepseek_v3", Options(expected), &report);
  ASSERT_FALSE(loaded.ok());
  EXPECT_THAT(report.missing, IsEmpty());
  EXPECT_THAT(report.unexpected, IsEmpty());
  EXPECT_THAT(
      report.mismatched,
      UnorderedElementsAre(
          HasSubstr(down2 + "_scale: F32 scales, but " + kDown +
                    " is kept packed int4 with its scales as stored, which must be BF16"),
          HasSubstr(kGateUp + ": kept packed int4, which is read with its zero points; expect " +
                    kGateUp + "_zero_point too"),
          HasSubstr(kShared + ": kept packed int4 (uint8), but its rule"),
          HasSubstr("model.norm.weight_scale: int4 scales and zero points are loaded only beside "
                    "a target kept packed")));
  EXPECT_EQ(report.num_bytes_read, BytesOf(ckpt.shards(), [](const std::string& name) {
              return name.ends_with("_shape");
            }));
}

INSTANTIATE_TEST_SUITE_P(Asymmetric32, Int4ProblemsTest,
                         ::testing::Values(Scheme{
                             .group_size = 32, .symmetric = false, .hidden = 256, .inter = 96}),
                         SchemeName);

TEST(Int4Test, DequantizeIntoStridedDestinationsEqualsReference) {
  at::manual_seed(8);
  for (const int64_t group_size : {32, 12, 128}) {
    for (at::ScalarType scale_dtype : {at::kBFloat16, at::kFloat, at::kHalf}) {
      SCOPED_TRACE(std::to_string(group_size) + " " + c10::toString(scale_dtype));
      const int64_t rows = 37, cols = 70;
      const int64_t groups = NumInt4Groups(cols, group_size);
      Int4Linear w{.q = at::randint(-8, 8, {rows, cols}, at::kChar),
                   .scale = (at::rand({rows, groups}) + 0.01).to(scale_dtype),
                   .zero = at::randint(-8, 8, {rows, groups}, at::kChar)};
      const at::Tensor packed = PackNibbles(w.q, 1);
      const at::Tensor zero = PackNibbles(w.zero, 0);
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
        SCOPED_TRACE(c10::toString(dtype));
        const at::Tensor ref = Reference(w, group_size, dtype);
        at::Tensor wide = at::zeros({2, rows + 3, cols}, dtype);
        at::Tensor rows_view = wide.select(0, 1).narrow(0, 3, rows);
        ASSERT_TRUE(DequantizePackedInt4Into(rows_view, packed, w.scale, zero, group_size).ok());
        EXPECT_TRUE(SameBytes(rows_view, ref));
        EXPECT_EQ(wide.select(0, 0).count_nonzero().item<int64_t>(), 0);
        at::Tensor transposed = at::zeros({cols, rows}, dtype).t();
        ASSERT_TRUE(DequantizePackedInt4Into(transposed, packed, w.scale, zero, group_size).ok());
        EXPECT_TRUE(SameBytes(transposed, ref));
        // Symmetric: no zero points, q alone.
        Int4Linear sym = w;
        sym.zero = at::Tensor();
        at::Tensor out = at::empty({rows, cols}, dtype);
        ASSERT_TRUE(DequantizePackedInt4Into(out, packed, w.scale, at::Tensor(), group_size).ok());
        EXPECT_TRUE(SameBytes(out, Reference(sym, group_size, dtype)));
      }
      at::Tensor unpacked = at::empty({rows, groups}, at::kChar);
      ASSERT_TRUE(UnpackInt4ZeroPointsInto(unpacked, zero).ok());
      EXPECT_TRUE(at::equal(unpacked, w.zero));
    }
  }
}

TEST(Int4Test, ReferenceEqualsHandComputedValues) {
  // Row 0: q = -8 .. 7 then 0 .. 3 (20 values, groups of 8: the last has 4);
  // row 1: all 7. Zero points 2 and -3 per row's groups.
  std::vector<int8_t> q_values;
  for (int v = -8; v < 8; ++v) q_values.push_back(static_cast<int8_t>(v));
  for (int v = 0; v < 4; ++v) q_values.push_back(static_cast<int8_t>(v));
  for (int c = 0; c < 20; ++c) q_values.push_back(7);
  Int4Linear w{
      .q = at::tensor(q_values, at::kChar).reshape({2, 20}),
      .scale = at::tensor({0.1f, 0.37f, 3.0f, 1.0f, 0.5f, 0.0123f}).reshape({2, 3}),
      .zero = at::tensor(std::vector<int8_t>{2, -3, 0, -8, 7, 1}, at::kChar).reshape({2, 3})};
  for (at::ScalarType scale_dtype : {at::kFloat, at::kBFloat16}) {
    Int4Linear typed = w;
    typed.scale = w.scale.to(scale_dtype);
    at::Tensor out = at::empty({2, 20});
    ASSERT_TRUE(DequantizePackedInt4Into(out, PackNibbles(typed.q, 1), typed.scale,
                                         PackNibbles(typed.zero, 0), 8)
                    .ok());
    for (int64_t r = 0; r < 2; ++r) {
      for (int64_t c = 0; c < 20; ++c) {
        const float s = typed.scale[r][c / 8].to(at::kFloat).item<float>();
        const int diff = typed.q[r][c].item<int8_t>() - typed.zero[r][c / 8].item<int8_t>();
        float want = static_cast<float>(diff) * s;
        if (scale_dtype == at::kBFloat16) want = static_cast<float>(c10::BFloat16(want));
        EXPECT_EQ(out[r][c].item<float>(), want) << r << "," << c;
      }
    }
    EXPECT_TRUE(SameBytes(out, Reference(typed, 8, at::kFloat)));
  }
}

TEST(Int4Test, ShapeErrorsSayWhatDoesNotFit) {
  const at::Tensor packed = at::zeros({4, 3}, at::kInt);  // 17 .. 24 columns
  const at::Tensor scale = at::ones({4, 1}, at::kBFloat16);
  at::Tensor out = at::empty({4, 20});
  EXPECT_TRUE(DequantizePackedInt4Into(out, packed, scale, at::Tensor(), 32).ok());
  EXPECT_THAT(
      DequantizePackedInt4Into(at::empty({4, 30}), packed, scale, at::Tensor(), 32).message(),
      HasSubstr("needs Int [4, 4]"));
  EXPECT_THAT(DequantizePackedInt4Into(out, packed, scale, at::Tensor(), 8).message(),
              HasSubstr("needs Float, BFloat16 or Half [4, 3]"));
  EXPECT_THAT(
      DequantizePackedInt4Into(out, packed, scale, at::zeros({4, 1}, at::kInt), 32).message(),
      HasSubstr("needs Int [1, 1]"));
  EXPECT_THAT(
      DequantizePackedInt4Into(at::empty({4, 20}, at::kInt), packed, scale, at::Tensor(), 32)
          .message(),
      HasSubstr("2-D floating tensor"));
}

// The reference ops, for a rule without a fused path, see an int4 source
// widened first.
TEST(Int4LoaderRules, RulesWithoutAFusedPathDequantizeFirst) {
  absl::StatusOr<MappingTable> table = TransposingTable();
  ASSERT_TRUE(table.ok()) << table.status();
  at::manual_seed(9);
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "moefit_int4_t";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  Int4Linear w{.q = at::randint(-8, 8, {40, 52}, at::kChar),
               .scale = (at::rand({40, 2}) + 0.1).to(at::kBFloat16)};
  ASSERT_TRUE(
      SaveTensors(dir / "model.safetensors", {{"w.weight_packed", PackNibbles(w.q, 1)},
                                              {"w.weight_scale", w.scale},
                                              {"w.weight_shape", at::tensor({40, 52}, at::kInt)}})
          .ok());
  LoadOptions options{.expected = {{"w_t", {{52, 40}, at::kFloat}}}};
  options.int4 = PackedInt4Format{.group_size = 32, .symmetric = true};
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir, *table, options);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(SameBytes(loaded->at("w_t"), Reference(w, 32, at::kFloat).t()));
  options.int4->group_size = 0;
  EXPECT_THAT(LoadCheckpoint(dir, *table, options).status().message(),
              HasSubstr("int4 group size must be positive"));
  std::filesystem::remove_all(dir);
}

TEST_P(Int4LoaderTest, StoredFormatQueriesReadHeadersOnly) {
  const Int4Checkpoint ckpt(GetParam(), 10);
  Write(ckpt.shards());
  absl::StatusOr<bool> int4 = ExpertsStoredAsInt4(dir_, "deepseek_v3");
  ASSERT_TRUE(int4.ok()) << int4.status();
  EXPECT_TRUE(*int4);
  absl::StatusOr<bool> fp8 = ExpertsStoredAsFp8(dir_, "deepseek_v3");
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  EXPECT_FALSE(*fp8);
  // The dense weights are BF16, the packed words are not weights of a dtype.
  absl::StatusOr<at::ScalarType> stored = StoredWeightDtype(dir_);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(*stored, at::kBFloat16);
  // Dequantized to BF16 (companions dropped): not int4 any more.
  std::vector<NamedTensors> converted(1);
  for (const auto& [name, t] : ckpt.shards()[0]) {
    if (name.ends_with("_packed")) {
      const std::string base = name.substr(0, name.size() - 7);
      converted[0].emplace_back(base, ckpt.Ref(base, at::kBFloat16));
    } else {
      converted[0].emplace_back(name, t);
    }
  }
  Write(converted);
  int4 = ExpertsStoredAsInt4(dir_, "deepseek_v3");
  ASSERT_TRUE(int4.ok()) << int4.status();
  EXPECT_FALSE(*int4);
}

// --- The float-quantized FP8 variant: `X.weight_scale` ------------------------

constexpr std::array<int64_t, 2> kBlock = {128, 128};

class Fp8ScaleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("moefit_fp8s_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    at::manual_seed(11);
    auto add = [&](const std::string& name, int64_t rows, int64_t cols) {
      const at::Tensor w = (at::randn({rows, cols}) * 50).clamp(-440, 440).to(at::kFloat8_e4m3fn);
      const at::Tensor s =
          (at::rand(BlockScaleShape({rows, cols}, kBlock)) * 1e-3 + 1e-4).to(at::kBFloat16);
      shards_[0].emplace_back(name, w);
      shards_[1].emplace_back(name + "_scale", s);
    };
    shards_[0].emplace_back("model.norm.weight", at::randn({200}).to(at::kBFloat16));
    add(kLayer + "self_attn.q_a_proj.weight", 300, 200);
    for (int64_t e = 0; e < kNumExperts; ++e) {
      add(Expert(e, "gate_proj"), 256, 200);
      add(Expert(e, "up_proj"), 256, 200);
      add(Expert(e, "down_proj"), 200, 256);
    }
    for (size_t shard_idx = 0; shard_idx < shards_.size(); ++shard_idx) {
      ASSERT_TRUE(SaveTensors(dir_ / ShardFileName(shard_idx, shards_.size()), shards_[shard_idx],
                              {.sync = false})
                      .ok());
    }
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  const at::Tensor& Get(const std::string& name) const {
    for (const NamedTensors& shard : shards_) {
      for (const auto& [n, t] : shard) {
        if (n == name) return t;
      }
    }
    ADD_FAILURE() << "no " << name;
    static const at::Tensor kNone;
    return kNone;
  }
  at::Tensor Ref(const std::string& name, at::ScalarType dtype) const {
    absl::StatusOr<at::Tensor> out =
        DequantizeBlockFp8Reference(Get(name), Get(name + "_scale"), kBlock, dtype);
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? *out : at::Tensor();
  }
  static LoadOptions Options() {
    LoadOptions options{.num_threads = 2};
    options.fp8_scale_suffix = std::string(kScaleSuffix);
    return options;
  }

  std::vector<NamedTensors> shards_ = std::vector<NamedTensors>(2);
  std::filesystem::path dir_;
};

TEST_F(Fp8ScaleTest, LoadsAsTheScaleInvVariantDoes) {
  LoadOptions options = Options();
  options.expected = {{"model.norm.weight", {{200}, at::kBFloat16}},
                      {kLayer + "self_attn.q_a_proj.weight", {{300, 200}, at::kFloat}},
                      {kGateUp, {{2, 512, 200}, at::kBFloat16}},
                      {kDown, {{2, 200, 256}, at::kBFloat16}}};
  options.first_expert = 2;
  options.num_experts = 2;
  LoadReport report;
  absl::StatusOr<TensorMap> loaded = LoadCheckpoint(dir_, "deepseek_v3", options, &report);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_THAT(report.unexpected, IsEmpty());
  EXPECT_TRUE(SameBytes(loaded->at(kLayer + "self_attn.q_a_proj.weight"),
                        Ref(kLayer + "self_attn.q_a_proj.weight", at::kFloat)));
  uint64_t want_bytes = 0;
  for (const NamedTensors& shard : shards_) {
    for (const auto& [name, t] : shard) {
      const bool mine = name.find(".experts.") == std::string::npos ||
                        name.find(".experts.2.") != std::string::npos ||
                        name.find(".experts.3.") != std::string::npos;
      if (mine) want_bytes += t.nbytes();
    }
  }
  EXPECT_EQ(report.num_bytes_read, want_bytes);
  for (int64_t e = 0; e < 2; ++e) {
    EXPECT_TRUE(
        SameBytes(loaded->at(kGateUp)[e], at::cat({Ref(Expert(2 + e, "gate_proj"), at::kBFloat16),
                                                   Ref(Expert(2 + e, "up_proj"), at::kBFloat16)})));
    EXPECT_TRUE(SameBytes(loaded->at(kDown)[e], Ref(Expert(2 + e, "down_proj"), at::kBFloat16)));
  }
  // Kept in FP8: the runtime scale grid keeps its name, `<target>_scale_inv`.
  options.expected[kGateUp].dtype = at::kFloat8_e4m3fn;
  options.expected[kGateUp + "_scale_inv"] = {{2, 4, 2}, at::kFloat};
  loaded = LoadCheckpoint(dir_, "deepseek_v3", options, &report);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  for (int64_t e = 0; e < 2; ++e) {
    const std::string gate = Expert(2 + e, "gate_proj"), up = Expert(2 + e, "up_proj");
    EXPECT_TRUE(SameBytes(loaded->at(kGateUp)[e], at::cat({Get(gate), Get(up)})));
    EXPECT_TRUE(SameBytes(loaded->at(kGateUp + "_scale_inv")[e],
                          at::cat({Get(gate + "_scale"), Get(up + "_scale")}).to(at::kFloat)));
  }
  absl::StatusOr<bool> fp8 = ExpertsStoredAsFp8(dir_, "deepseek_v3");
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  EXPECT_TRUE(*fp8);
}

TEST_F(Fp8ScaleTest, MissingScaleIsNamedWithItsSuffix) {
  std::erase_if(shards_[1],
                [](const auto& entry) { return entry.first == Expert(1, "up_proj") + "_scale"; });
  ASSERT_TRUE(SaveTensors(dir_ / ShardFileName(1, 2), shards_[1], {.sync = false}).ok());
  LoadReport report;
  EXPECT_FALSE(LoadCheckpoint(dir_, "deepseek_v3", Options(), &report).ok());
  EXPECT_THAT(report.missing, ElementsAre(Expert(1, "up_proj") + "_scale"));
  // With DeepSeek's suffix, the `_scale` tensors are no companions: every one
  // is unexpected and every FP8 weight lacks its `_scale_inv`.
  LoadOptions scale_inv = Options();
  scale_inv.fp8_scale_suffix = std::string(kScaleInvSuffix);
  EXPECT_FALSE(LoadCheckpoint(dir_, "deepseek_v3", scale_inv, &report).ok());
  EXPECT_THAT(report.missing, ::testing::Contains(Expert(0, "up_proj") + "_scale_inv"));
  EXPECT_THAT(report.unexpected, ::testing::Contains(Expert(0, "up_proj") + "_scale"));
}

}  // namespace
}  // namespace moefit::checkpoint
