// bfloat16 experts with float32 master weights: the parameters are float32,
// the compute copies bfloat16 and equal to the rounded masters after every
// step; an update far below bfloat16's resolution moves the masters (and is
// lost without them); and training tracks the float32 run.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sstream>

#include "framework/data.h"
#include "framework/model.h"
#include "framework/trainer.h"
#include "launch/corpus.h"
#include "tests/framework/test_configs.h"

namespace moefit::framework {
namespace {

launch::RunConfig Small(const std::vector<std::string>& extra) {
  std::vector<std::string> sets = {"model.hidden_size=64", "model.num_hidden_layers=2",
                                   "model.num_attention_heads=4", "model.num_key_value_heads=2",
                                   "model.head_dim=16", "model.moe_intermediate_size=32",
                                   "train.seq_len=32", "train.micro_batch_size=4",
                                   "logging.metrics_file=", "schedule.warmup_steps=0"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return DemoRunConfig(sets);
}

std::unique_ptr<MoeModel> Build(const launch::RunConfig& run, bool masters) {
  ModelRuntime rt = run.runtime;
  rt.expert_master_weights = masters;
  auto m = MoeModel::Create(run.model, rt, run.train.seed);
  EXPECT_TRUE(m.ok()) << m.status();
  return std::move(*m);
}

std::vector<StepStats> Train(MoeModel& model, const launch::RunConfig& run) {
  return TrainOnCorpus(model, run);
}

std::vector<at::Tensor> ExpertParams(const MoeModel& m) {
  std::vector<at::Tensor> out;
  for (const Parameter& p : m.parameters()) {
    if (p.expert) out.push_back(p.tensor.detach().clone());
  }
  return out;
}

TEST(MasterWeights, CopiesAreTheRoundedMasters) {
  launch::RunConfig run = Small({"experts.dtype=bfloat16", "train.steps=3"});
  auto m = Build(run, true);
  ASSERT_TRUE(m->runtime().expert_master_weights);
  std::vector<at::Tensor> masters;
  for (const Parameter& p : m->parameters()) {
    if (!p.expert) continue;
    EXPECT_EQ(p.tensor.scalar_type(), at::kFloat) << p.name;
    masters.push_back(p.tensor);
  }
  const std::vector<at::Tensor> copies = m->expert_copies();
  ASSERT_EQ(copies.size(), masters.size());  // gate_up and down of each MoE layer
  const std::vector<at::Tensor> before = ExpertParams(*m);
  Train(*m, run);
  for (size_t i = 0; i < copies.size(); ++i) {
    EXPECT_EQ(copies[i].scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(copies[i], masters[i].to(at::kBFloat16))) << i;
    EXPECT_FALSE(at::equal(masters[i], before[i])) << i << " did not train";
    EXPECT_FALSE(masters[i].grad().defined() && masters[i].grad().scalar_type() != at::kFloat);
  }
  // Without masters the model has no copies: its parameters are bfloat16.
  auto plain = Build(run, false);
  EXPECT_TRUE(plain->expert_copies().empty());
}

// AdamW's first step moves every weight by about lr: at 1e-6, far below the
// spacing of bfloat16 near 0.02 (about 1.2e-4), so bfloat16 weights keep
// their values and only float32 masters move.
TEST(MasterWeights, SmallUpdatesSurvive) {
  launch::RunConfig run =
      Small({"experts.dtype=bfloat16", "train.steps=1", "optimizer.lr=1e-6",
           "optimizer.weight_decay=0", "model.initializer_range=0.02"});
  auto with = Build(run, true), without = Build(run, false);
  const std::vector<at::Tensor> a0 = ExpertParams(*with), b0 = ExpertParams(*without);
  Train(*with, run);
  Train(*without, run);
  const std::vector<at::Tensor> a1 = ExpertParams(*with), b1 = ExpertParams(*without);
  double moved_with = 0, moved_without = 0, total = 0;
  for (size_t i = 0; i < a0.size(); ++i) {
    moved_with += a1[i].ne(a0[i]).sum().item<double>();
    moved_without += b1[i].ne(b0[i]).sum().item<double>();
    total += static_cast<double>(a0[i].numel());
  }
  EXPECT_GT(moved_with / total, 0.5);      // every expert that got tokens
  EXPECT_LT(moved_without / total, 0.05);  // rounded away
}

TEST(MasterWeights, TrainingTracksFloat32) {
  launch::RunConfig narrow = Small({"experts.dtype=bfloat16", "train.steps=8", "optimizer.lr=3e-3"});
  launch::RunConfig wide = Small({"experts.dtype=float32", "train.steps=8", "optimizer.lr=3e-3"});
  auto a = Build(narrow, true), b = Build(wide, true);
  const std::vector<StepStats> sa = Train(*a, narrow), sb = Train(*b, wide);
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_NEAR(sa[i].loss, sb[i].loss, 2e-2 * sb[i].loss) << "step " << i;
  }
  EXPECT_LT(sa.back().loss, sa.front().loss - 0.1);
}

}  // namespace
}  // namespace moefit::framework
