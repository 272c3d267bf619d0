// Packed SFT sequences keep their samples apart: the JSONL layout (first fit,
// long samples cut, padding, positions restarting, the first token of every
// sample never a target), the byte stream's layout unchanged, and the model on
// a row holding two samples giving the logits, loss sum and gradients of the
// two samples run alone (fp32) for GQA (qwen3_moe; glm4_moe with partial
// rotary) and multi-head latent attention (deepseek_v3), also through the
// trainer.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "framework/attention.h"
#include "framework/data.h"
#include "framework/model.h"
#include "framework/trainer.h"
#include "launch/config.h"
#include "tests/framework/test_configs.h"

namespace moefit::framework {
namespace {

at::Tensor Longs(const std::vector<int64_t>& v) { return at::tensor(v, at::kLong); }

std::string WriteJsonl(const std::string& name, const std::vector<std::string>& lines) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream f(path);
  for (const std::string& l : lines) f << l << "\n";
  return path;
}

std::string JsonArray(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string Sample(const std::vector<int64_t>& ids, const std::vector<int64_t>& labels = {}) {
  std::string s = "{\"input_ids\": " + JsonArray(ids);
  if (!labels.empty()) s += ", \"labels\": " + JsonArray(labels);
  return s + "}";
}

// Samples of 5, 4, 3 and 10 tokens into rows of 8, first fit in file order:
// A -> row 0, B (no room left in row 0) -> row 1, C -> row 0, D's first 8
// tokens -> row 2, its last 2 -> row 1, then padding.
TEST(PackedData, FirstFitWholeSamplesPositionsSegmentsAndLabels) {
  const std::string path =
      WriteJsonl("first_fit.jsonl", {Sample({1, 2, 3, 4, 5}, {-100, -100, 3, 4, 5}),
                                     Sample({11, 12, 13, 14}), "", Sample({21, 22, 23}),
                                     Sample({31, 32, 33, 34, 35, 36, 37, 38, 39, 40}), Sample({})});
  auto d = TokenDataset::FromJsonl(path, 8, 64);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->num_sequences(), 3);
  Batch b = d->Gather({0, 1, 2});
  const int64_t x = kIgnoreIndex;
  EXPECT_TRUE(at::equal(b.input_ids, Longs({1,  2,  3,  4,  5,  21, 22, 23,  //
                                            11, 12, 13, 14, 39, 40, 0,  0,   //
                                            31, 32, 33, 34, 35, 36, 37, 38})
                                         .view({3, 8})));
  // Each sample's first token is not a target (nor is padding).
  EXPECT_TRUE(at::equal(b.labels, Longs({x, x,  3,  4,  5,  x,  22, 23,  //
                                         x, 12, 13, 14, x,  40, x,  x,   //
                                         x, 32, 33, 34, 35, 36, 37, 38})
                                      .view({3, 8})));
  EXPECT_TRUE(at::equal(b.position_ids, Longs({0, 1, 2, 3, 4, 0, 1, 2,  //
                                               0, 1, 2, 3, 0, 1, 0, 1,  //
                                               0, 1, 2, 3, 4, 5, 6, 7})
                                            .view({3, 8})));
  EXPECT_TRUE(at::equal(b.segment_ids, Longs({0, 0, 0, 0, 0, 1, 1, 1,  //
                                              0, 0, 0, 0, 1, 1, 2, 2,  //
                                              0, 0, 0, 0, 0, 0, 0, 0})
                                           .view({3, 8})));
  EXPECT_EQ(CountTrainedTokens(b.labels), 3 + 2 + 3 + 1 + 7);
  // Gather follows the index order.
  EXPECT_TRUE(at::equal(d->Gather({2, 0}).position_ids[1], b.position_ids[0]));
}

TEST(PackedData, ErrorsNameTheFileAndLine) {
  auto bad_label = TokenDataset::FromJsonl(
      WriteJsonl("bad_label.jsonl", {Sample({1, 2}), Sample({1, 2}, {1, -5})}), 8, 64);
  ASSERT_FALSE(bad_label.ok());
  EXPECT_NE(bad_label.status().message().find("bad_label.jsonl:2: \"labels\" holds -5"),
            std::string::npos)
      << bad_label.status();
  auto empty = TokenDataset::FromJsonl(WriteJsonl("empty.jsonl", {Sample({})}), 8, 64);
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("no samples with tokens"), std::string::npos);
}

// The byte stream is cut as before: one segment per row, positions 0..T-1.
TEST(PackedData, TextStaysOneStream) {
  auto d = TokenDataset::FromText("abcdefghij", 4, "text");
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->num_sequences(), 2);
  Batch b = d->Gather({1, 0});
  EXPECT_TRUE(at::equal(b.input_ids, Longs({'e', 'f', 'g', 'h', 'a', 'b', 'c', 'd'}).view({2, 4})));
  EXPECT_TRUE(at::equal(b.labels, b.input_ids));
  EXPECT_TRUE(at::equal(b.position_ids, Longs({0, 1, 2, 3, 0, 1, 2, 3}).view({2, 4})));
  EXPECT_TRUE(at::equal(b.segment_ids, at::zeros({2, 4}, at::kLong)));
}

TEST(PackedData, SegmentCausalMask) {
  at::Tensor m = SegmentCausalMask(Longs({0, 0, 1, 1, 1}).view({1, 5}));
  const std::vector<std::vector<int>> want = {
      {1, 0, 0, 0, 0}, {1, 1, 0, 0, 0}, {0, 0, 1, 0, 0}, {0, 0, 1, 1, 0}, {0, 0, 1, 1, 1}};
  ASSERT_EQ(m.sizes(), (std::vector<int64_t>{1, 1, 5, 5}));
  for (int i = 0; i < 5; ++i) {
    for (int j = 0; j < 5; ++j) EXPECT_EQ(m[0][0][i][j].item<bool>(), want[i][j] == 1) << i << j;
  }
}

// The demo's shape, small; one of three attention variants.
std::vector<std::string> FamilySets(const std::string& family) {
  if (family == "deepseek_v3") {
    return {"model.model_type=deepseek_v3",
            "model.q_lora_rank=24",
            "model.kv_lora_rank=16",
            "model.qk_nope_head_dim=16",
            "model.qk_rope_head_dim=8",
            "model.v_head_dim=16",
            "model.n_group=4",
            "model.topk_group=2",
            "model.first_k_dense_replace=1"};
  }
  if (family == "glm4_moe") {
    return {"model.model_type=glm4_moe", "model.attention_bias=true",
            "model.use_qk_norm=true",    "model.n_group=2",
            "model.topk_group=1",        "model.first_k_dense_replace=1"};
  }
  return {};
}

launch::RunConfig SmallRun(const std::string& family, std::vector<std::string> sets = {}) {
  for (const char* s : {"model.num_hidden_layers=2", "model.hidden_size=64", "model.head_dim=16",
                        "model.moe_intermediate_size=32", "model.router_aux_loss_coef=0",
                        "logging.metrics_file="}) {
    sets.push_back(s);
  }
  for (const std::string& s : FamilySets(family)) sets.push_back(s);
  return DemoRunConfig(sets);
}

std::vector<int64_t> RandomIds(int64_t n, at::Generator& gen) {
  at::Tensor t = at::randint(256, {n}, gen, at::kLong);
  return {t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n};
}

// Gradients of every parameter (zeros where none flowed), then cleared.
std::map<std::string, at::Tensor> TakeGrads(MoeModel& m) {
  std::map<std::string, at::Tensor> out;
  for (const Parameter& p : m.parameters()) {
    at::Tensor g = p.tensor.grad();
    out[p.name] = g.defined() ? g.detach().clone() : at::zeros_like(p.tensor);
    if (g.defined()) p.tensor.mutable_grad().reset();
  }
  return out;
}

class PackedEqualsAlone : public ::testing::TestWithParam<std::string> {};

// Samples A (9 tokens, the first three not trained) and B (6 tokens) share a
// row of 20 (5 of padding). Logits of each sample's tokens, the loss sum, the
// trained-token count and every parameter's gradient equal those of A and B
// run alone (SDPA's masked and causal kernels sum in different orders: 1e-5).
// Without the segments, B's tokens would see A's: far off.
TEST_P(PackedEqualsAlone, LogitsLossAndGradients) {
  launch::RunConfig run = SmallRun(GetParam());
  auto model = MoeModel::Create(run.model, run.runtime, 7);
  ASSERT_TRUE(model.ok()) << model.status();
  MoeModel& m = **model;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const std::vector<int64_t> a = RandomIds(9, gen), b = RandomIds(6, gen);
  std::vector<int64_t> a_labels = a;
  for (int i = 0; i < 3; ++i) a_labels[i] = kIgnoreIndex;
  auto data = TokenDataset::FromJsonl(
      WriteJsonl("two_" + GetParam() + ".jsonl", {Sample(a, a_labels), Sample(b)}), 20, 256);
  ASSERT_TRUE(data.ok()) << data.status();
  ASSERT_EQ(data->num_sequences(), 1);
  Batch packed = data->Gather({0});

  ForwardResult out = m.Forward(packed.input_ids, packed.position_ids, packed.segment_ids);
  LossSum loss = CausalLmLossSum(out.logits, packed.labels);
  loss.sum.backward();
  std::map<std::string, at::Tensor> packed_grads = TakeGrads(m);

  ForwardResult out_a = m.Forward(Longs(a).view({1, -1}));
  ForwardResult out_b = m.Forward(Longs(b).view({1, -1}));
  LossSum loss_a = CausalLmLossSum(out_a.logits, Longs(a_labels).view({1, -1}));
  LossSum loss_b = CausalLmLossSum(out_b.logits, Longs(b).view({1, -1}));
  (loss_a.sum + loss_b.sum).backward();
  std::map<std::string, at::Tensor> alone_grads = TakeGrads(m);

  const double tol = 1e-5;
  at::Tensor logits = out.logits.detach().to(at::kCPU);
  EXPECT_LT(
      (logits.narrow(1, 0, 9) - out_a.logits.detach().to(at::kCPU)).abs().max().item<double>(),
      tol);
  EXPECT_LT(
      (logits.narrow(1, 9, 6) - out_b.logits.detach().to(at::kCPU)).abs().max().item<double>(),
      tol);
  EXPECT_EQ(loss.num_tokens, loss_a.num_tokens + loss_b.num_tokens);
  EXPECT_EQ(loss.num_tokens, 6 + 5);
  const double want = (loss_a.sum + loss_b.sum).item<double>();
  EXPECT_NEAR(loss.sum.item<double>(), want, tol * want);
  for (const auto& [name, g] : alone_grads) {
    const double scale = std::max(1.0, g.abs().max().item<double>());
    EXPECT_LT((packed_grads[name] - g).abs().max().item<double>(), tol * scale) << name;
  }

  // The mask is what keeps B from A.
  at::Tensor unmasked =
      m.Forward(packed.input_ids, packed.position_ids).logits.detach().to(at::kCPU);
  EXPECT_GT(
      (unmasked.narrow(1, 9, 6) - out_b.logits.detach().to(at::kCPU)).abs().max().item<double>(),
      1e-3);
}

INSTANTIATE_TEST_SUITE_P(Attention, PackedEqualsAlone,
                         ::testing::Values("qwen3_moe", "glm4_moe", "deepseek_v3"));

// Rows of one segment with positions 0..T-1 (the byte stream) take the causal
// path unchanged: bit-identical logits with and without the layout.
TEST(PackedModel, OneSegmentPerRowIsBitIdentical) {
  for (const std::string family : {"qwen3_moe", "deepseek_v3"}) {
    launch::RunConfig run = SmallRun(family);
    auto model = MoeModel::Create(run.model, run.runtime, 3);
    ASSERT_TRUE(model.ok()) << model.status();
    auto data =
        TokenDataset::FromText(std::string(200, 'x') + "some text, then more text", 16, "text");
    ASSERT_TRUE(data.ok());
    Batch b = data->Gather({0, 3, 5});
    at::Tensor plain = (*model)->Forward(b.input_ids).logits;
    at::Tensor with = (*model)->Forward(b.input_ids, b.position_ids, b.segment_ids).logits;
    EXPECT_TRUE(at::equal(plain, with)) << family;
  }
}

// Through the trainer: the first step's loss on the packed row is the mean
// over both samples' trained tokens of their losses alone.
TEST(PackedModel, TrainerPassesTheLayout) {
  launch::RunConfig run = SmallRun("qwen3_moe", {"train.steps=1", "train.micro_batch_size=1"});
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const std::vector<int64_t> a = RandomIds(12, gen), b = RandomIds(10, gen);
  auto data = TokenDataset::FromJsonl(WriteJsonl("trainer.jsonl", {Sample(a), Sample(b)}), 24, 256);
  ASSERT_TRUE(data.ok()) << data.status();
  auto model = MoeModel::Create(run.model, run.runtime, run.train.seed);
  ASSERT_TRUE(model.ok()) << model.status();
  LossSum la =
      CausalLmLossSum((*model)->Forward(Longs(a).view({1, -1})).logits, Longs(a).view({1, -1}));
  LossSum lb =
      CausalLmLossSum((*model)->Forward(Longs(b).view({1, -1})).logits, Longs(b).view({1, -1}));
  const double want = (la.sum + lb.sum).item<double>() / (la.num_tokens + lb.num_tokens);
  Trainer trainer(**model, *data, run.train);
  StepStats s = trainer.Step(0);
  EXPECT_NEAR(s.loss, want, 1e-5 * want);
}

}  // namespace
}  // namespace moefit::framework
