// bfloat16 experts with float32 master weights: the parameters are float32,
// the compute copies bfloat16 and equal to the rounded masters after every
// step; an update far below bfloat16's resolution moves the masters (and is
// lost without them); and training tracks the float32 run.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

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

// At a fine-tuning learning rate (1e-5) most AdamW updates of a bfloat16
// weight round to nothing. With float32 masters the bfloat16 run's loss curve
// follows the float32 run's over 50 steps; without them it measurably does
// not. Compared: each run's loss change since step 0 (which cancels the
// constant offset bfloat16 activations add).
TEST(MasterWeights, FineTuningLearningRateTracksFloat32OnlyWithMasters) {
  const std::vector<std::string> common = {"train.steps=50", "optimizer.lr=1e-5",
                                           "optimizer.weight_decay=0", "optimizer.max_grad_norm=0"};
  auto config = [&](const char* dtype) {
    std::vector<std::string> sets = common;
    sets.push_back(std::string("experts.dtype=") + dtype);
    return Small(sets);
  };
  const launch::RunConfig narrow = config("bfloat16"), wide = config("float32");
  auto fp32 = Build(wide, true), with = Build(narrow, true), without = Build(narrow, false);
  const std::vector<StepStats> s32 = Train(*fp32, wide), sw = Train(*with, narrow),
                               sn = Train(*without, narrow);
  ASSERT_EQ(s32.size(), 50u);
  double err_with = 0, err_without = 0, moved = 0;
  for (size_t i = 1; i < s32.size(); ++i) {
    const double d32 = s32[i].loss - s32[0].loss;
    err_with = std::max(err_with, std::abs((sw[i].loss - sw[0].loss) - d32));
    err_without = std::max(err_without, std::abs((sn[i].loss - sn[0].loss) - d32));
    moved = std::max(moved, std::abs(d32));
  }
  std::printf("loss change over 50 steps (fp32) %.3g; worst deviation from it: bf16 with masters "
              "%.3g, without %.3g\n",
              moved, err_with, err_without);
  EXPECT_GT(moved, 1e-2);                // the float32 run learns
  EXPECT_LT(err_with, 0.01 * moved);      // with masters the curve stays on it
  EXPECT_GT(err_without, 5.0 * err_with);  // without, it measurably departs
}

// Stochastic rounding of the copies: each stays within one bfloat16 step of
// its master (not always the nearest), and the run trains like float32.
TEST(MasterWeights, StochasticRoundingKeepsCopiesWithinOneStep) {
  launch::RunConfig run = Small({"experts.dtype=bfloat16", "train.steps=4", "optimizer.lr=3e-3",
                                 "optimizer.stochastic_rounding=true"});
  auto m = Build(run, true);
  const std::vector<StepStats> stats = Train(*m, run);
  std::vector<at::Tensor> masters;
  for (const Parameter& p : m->parameters()) {
    if (p.expert) masters.push_back(p.tensor.detach());
  }
  const std::vector<at::Tensor> copies = m->expert_copies();
  ASSERT_EQ(copies.size(), masters.size());
  int64_t not_nearest = 0, total = 0;
  for (size_t i = 0; i < copies.size(); ++i) {
    const at::Tensor c = copies[i].to(at::kFloat), w = masters[i];
    // One bfloat16 step at w: 2^(exponent - 7).
    const at::Tensor step = at::pow(2.0, at::floor(at::log2(w.abs().clamp_min(1e-30))) - 7);
    EXPECT_TRUE(at::le((c - w).abs(), step).all().item<bool>()) << i;
    not_nearest += c.ne(w.to(at::kBFloat16).to(at::kFloat)).sum().item<int64_t>();
    total += w.numel();
  }
  EXPECT_GT(not_nearest, total / 20);  // stochastic, not round-to-nearest
  EXPECT_LT(stats.back().loss, stats.front().loss);
}

}  // namespace
}  // namespace moefit::framework
