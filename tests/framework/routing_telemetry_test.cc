// Routing telemetry of real training steps, one process: the per-layer
// figures against what they must equal -- the decayed counters against the
// direct weighted sum of the reported tokens per expert, one MoE layer's
// Switch loss against the model's balance loss, the sigmoid routers' layer
// losses summing to the model's, entropies within [0, log E], the correction
// biases' spread against the biases themselves, gradient accumulation giving
// the figures of one large micro-batch, telemetry off leaving the losses
// alone. (tests/framework/ep_training_test.cc checks that 2 and 4 processes
// report the numbers of one.)
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "framework/data.h"
#include "framework/model.h"
#include "framework/trainer.h"
#include "launch/config.h"
#include "router/routing_stats.h"
#include "tests/framework/test_configs.h"

namespace moefit::framework {
namespace {

std::vector<std::string> Small(std::vector<std::string> sets) {
  for (const char* s :
       {"train.steps=6", "train.seq_len=32", "model.hidden_size=64", "model.head_dim=16",
        "model.moe_intermediate_size=32", "logging.metrics_file=", "train.micro_batch_size=4"}) {
    sets.insert(sets.begin(), s);
  }
  return sets;
}

struct TrainedRun {
  std::vector<StepStats> steps;
  std::unique_ptr<MoeModel> model;
};

TrainedRun Train(const launch::RunConfig& run) {
  auto model = MoeModel::Create(run.model, run.runtime, run.train.seed);
  EXPECT_TRUE(model.ok()) << model.status();
  std::vector<StepStats> steps = TrainOnCorpus(**model, run);
  return {std::move(steps), std::move(*model)};
}

TEST(RoutingTelemetry, DecayedCountersFollowTheReportedCounts) {
  launch::RunConfig run =
      DemoRunConfig(Small({"model.num_hidden_layers=2", "logging.routing_half_life_steps=2.5"}));
  TrainedRun r = Train(run);
  ASSERT_EQ(r.steps.size(), 6u);
  const int64_t experts = run.model.num_experts;
  for (size_t layer = 0; layer < 2; ++layer) {
    std::vector<std::vector<double>> history;
    for (const StepStats& s : r.steps) {
      ASSERT_EQ(s.moe_layers.size(), 2u);
      const LayerLoad& ll = s.moe_layers[layer];
      history.emplace_back(ll.tokens_per_expert.begin(), ll.tokens_per_expert.end());
      const std::vector<double> direct = router::DecayedSumDirect(history, 2.5);
      ASSERT_EQ(ll.decayed_load.size(), static_cast<size_t>(experts));
      for (int64_t e = 0; e < experts; ++e) {
        EXPECT_NEAR(ll.decayed_load[e], direct[e], 1e-9 * direct[e]) << "step " << s.step;
      }
      const router::LoadImbalance imb = router::ComputeLoadImbalance(history.back());
      EXPECT_EQ(ll.max_over_mean, imb.max_over_mean);
      EXPECT_EQ(ll.cv, imb.cv);
      EXPECT_GT(ll.cv, 0.0);
      // Router entropy: a mean over tokens of an entropy over 8 experts.
      EXPECT_GT(ll.router_entropy, 0.5);
      EXPECT_LT(ll.router_entropy, std::log(static_cast<double>(experts)));
      ASSERT_TRUE(ll.balance_loss.has_value());
      EXPECT_FALSE(ll.correction_bias.has_value());  // softmax routers have none
    }
  }
}

// With one MoE layer, HF's loss over "all layers" is that layer's loss.
TEST(RoutingTelemetry, OneLayersSwitchLossIsTheModelsBalanceLoss) {
  TrainedRun r =
      Train(DemoRunConfig(Small({"model.num_hidden_layers=1", "train.grad_accum_steps=2"})));
  for (const StepStats& s : r.steps) {
    ASSERT_EQ(s.moe_layers.size(), 1u);
    ASSERT_TRUE(s.moe_layers[0].balance_loss.has_value());
    EXPECT_NEAR(*s.moe_layers[0].balance_loss, s.aux_loss, 1e-6 * s.aux_loss);
    EXPECT_GT(s.aux_loss, 1.0);  // about num_experts_per_tok = 2
  }
}

// The sequence-wise loss adds up over layers: the layers' losses sum to the
// model's; the correction biases' spread is that of the biases after the step.
TEST(RoutingTelemetry, SigmoidLayerLossesSumToTheModelsAndBiasesSpread) {
  TrainedRun r = Train(DemoRunConfig(Small(kSmallDeepseekV3)));
  for (const StepStats& s : r.steps) {
    ASSERT_EQ(s.moe_layers.size(), 2u);  // layer 0 is dense
    double sum = 0;
    for (const LayerLoad& ll : s.moe_layers) {
      ASSERT_TRUE(ll.balance_loss.has_value());
      sum += *ll.balance_loss;
      ASSERT_TRUE(ll.correction_bias.has_value());
      EXPECT_LE(ll.router_entropy, std::log(static_cast<double>(ll.tokens_per_expert.size())));
    }
    EXPECT_NEAR(sum, s.aux_loss, 1e-6 * s.aux_loss);
  }
  // After the last step the reported spread is that of the buffers.
  for (const Parameter& b : r.model->buffers()) {
    const int64_t layer = b.name == "model.layers.1.mlp.gate.e_score_correction_bias" ? 0 : 1;
    at::Tensor v = b.tensor.to(at::kDouble);
    const router::Spread& spread = *r.steps.back().moe_layers[layer].correction_bias;
    EXPECT_EQ(spread.min, v.min().item<double>()) << b.name;
    EXPECT_EQ(spread.max, v.max().item<double>()) << b.name;
    EXPECT_NEAR(spread.std, v.std(/*unbiased=*/false).item<double>(), 1e-12) << b.name;
    EXPECT_GT(spread.max - spread.min, 0.01) << b.name;  // rate 0.01 over 6 steps moved them
  }
}

// Two micro-batches of 2 give the figures of one of 4 on the same weights
// (the first step: the two runs' updates then differ by rounding, which
// flips near-tied routing choices). The mean of the two halves' Switch
// losses is not the loss of the whole, so that one is left out.
TEST(RoutingTelemetry, AccumulationGivesTheFiguresOfOneMicroBatch) {
  const std::vector<std::string> one_step = {"model.num_hidden_layers=2", "train.steps=1"};
  TrainedRun one = Train(DemoRunConfig(Small(one_step)));
  std::vector<std::string> split = one_step;
  split.push_back("train.micro_batch_size=2");
  split.push_back("train.grad_accum_steps=2");
  TrainedRun two = Train(DemoRunConfig(Small(split)));
  ASSERT_EQ(one.steps.size(), 1u);
  ASSERT_EQ(two.steps.size(), 1u);
  for (size_t i = 0; i < one.steps.size(); ++i) {
    for (size_t l = 0; l < 2; ++l) {
      const LayerLoad& a = one.steps[i].moe_layers[l];
      const LayerLoad& b = two.steps[i].moe_layers[l];
      EXPECT_EQ(a.tokens_per_expert, b.tokens_per_expert) << "step " << i;
      for (size_t e = 0; e < a.decayed_load.size(); ++e) {
        EXPECT_NEAR(a.decayed_load[e], b.decayed_load[e], 1e-9 * a.decayed_load[e]);
      }
      EXPECT_NEAR(a.router_entropy, b.router_entropy, 1e-5 * a.router_entropy) << "step " << i;
    }
  }
}

TEST(RoutingTelemetry, OffChangesNoLossAndLeavesCountsOnly) {
  TrainedRun on = Train(DemoRunConfig(Small({"model.num_hidden_layers=2"})));
  TrainedRun off =
      Train(DemoRunConfig(Small({"model.num_hidden_layers=2", "logging.routing_telemetry=false"})));
  for (size_t i = 0; i < on.steps.size(); ++i) {
    EXPECT_EQ(on.steps[i].loss, off.steps[i].loss);
    EXPECT_EQ(on.steps[i].aux_loss, off.steps[i].aux_loss);
    const LayerLoad& ll = off.steps[i].moe_layers[0];
    EXPECT_EQ(ll.tokens_per_expert, on.steps[i].moe_layers[0].tokens_per_expert);
    EXPECT_EQ(ll.max_over_mean, on.steps[i].moe_layers[0].max_over_mean);
    EXPECT_TRUE(ll.decayed_load.empty());
    EXPECT_FALSE(ll.balance_loss.has_value());
    EXPECT_EQ(ll.router_entropy, 0.0);
  }
}

}  // namespace
}  // namespace moefit::framework
