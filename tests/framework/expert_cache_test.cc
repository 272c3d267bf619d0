// The hot-expert cache on its CPU twin: the cache's device replaced by a
// second CPU compute path (ModelRuntime::expert_cache_device = CPU), the
// cached experts computed there by the eager backend from the cache's own
// copies of their weights. Moving experts in and out must change no result:
//  * with eager experts on the host too, every loss, gradient norm and final
//    parameter equals the run without the cache bit for bit (full training in
//    float32, bfloat16 experts with float32 masters, LoRA on a frozen base
//    whose cached weights stay on the device between changes of the set);
//  * with the grouped backend on the host, within the two backends' rounding;
// while the cache really works: it holds experts from the second step on,
// serves a share of the rows, and its set changes during the run (a short
// half-life and every-step reconsideration make it move; under LoRA, whose
// frozen router barely moves, the set is also rotated by hand every step).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "framework/data.h"
#include "framework/model.h"
#include "framework/step_summaries.h"
#include "framework/trainer.h"
#include "launch/config.h"
#include "tests/framework/test_configs.h"

namespace moefit::framework {
namespace {

struct Trained {
  std::vector<StepStats> steps;
  std::map<std::string, at::Tensor> params;
};

// With `rotate`, after each step the cached experts of every MoE layer are
// set by hand to a pair that moves with the step (on top of the policy's
// choice), so that experts go in and out of the cache all the time.
Trained Train(launch::RunConfig run, bool cache, bool rotate = false) {
  if (cache) {
    run.runtime.expert_cache_device = c10::Device(c10::kCPU);
    run.train.gpu_cache_experts = 5;  // of 2 layers x 8 experts
    run.train.gpu_cache_every_steps = 1;
  }
  auto model = MoeModel::Create(run.model, run.runtime, run.train.seed);
  EXPECT_TRUE(model.ok()) << model.status();
  MoeModel& m = **model;
  std::vector<StepStats> stats = TrainOnCorpus(m, run, [&](const StepStats& st) {
    if (!rotate) return;
    for (const LayerLoad& ll : st.moe_layers) {
      std::vector<int64_t> pair = {st.step % 8, (st.step + 3) % 8};
      std::sort(pair.begin(), pair.end());
      m.SetCachedExperts(ll.layer_idx, pair);
    }
  });
  Trained out{std::move(stats), {}};
  for (const Parameter& p : (*model)->trainable_parameters()) {
    out.params[p.name] = p.tensor.detach().clone();
  }
  return out;
}

launch::RunConfig Small(std::vector<std::string> sets) {
  for (const char* s :
       {"train.steps=8", "train.seq_len=32", "model.hidden_size=64", "model.head_dim=16",
        "model.moe_intermediate_size=32", "model.num_hidden_layers=2", "logging.metrics_file=",
        "train.micro_batch_size=4", "logging.routing_half_life_steps=1", "optimizer.eps=1e-4"}) {
    sets.insert(sets.begin(), s);
  }
  return DemoRunConfig(sets);
}

// The cache held experts, served rows, and changed its set during the run.
void ExpectTheCacheWorked(const Trained& cached) {
  std::set<std::vector<int64_t>> sets;
  double served = 0;
  for (const StepStats& s : cached.steps) {
    ASSERT_TRUE(s.gpu_cache);
    served += s.gpu_cache_share;
    std::vector<int64_t> held;
    for (const LayerLoad& ll : s.moe_layers) {
      for (int64_t x : ll.gpu_experts) held.push_back(ll.layer_idx * 1000 + x);
    }
    if (s.step > 1) {
      EXPECT_FALSE(held.empty()) << "step " << s.step;
    }
    EXPECT_LE(held.size(), 5u);
    sets.insert(held);
  }
  EXPECT_EQ(cached.steps.front().gpu_cache_share, 0.0);  // nothing cached before step 1's counts
  EXPECT_GT(served / static_cast<double>(cached.steps.size() - 1), 0.1);
  EXPECT_GE(sets.size(), 3u) << "the cached set never moved";
  // The expert map outlines the experts the cache computed.
  const StepStats& last = cached.steps.back();
  const ExpertMap map = StepExpertMap(last);
  ASSERT_EQ(map.hot.size(), map.load.size());
  for (size_t l = 0; l < last.moe_layers.size(); ++l) {
    std::vector<int64_t> outlined;
    for (int64_t x = 0; x < map.num_experts; ++x) {
      if (map.hot[l * map.num_experts + x]) outlined.push_back(x);
    }
    EXPECT_EQ(outlined, last.moe_layers[l].gpu_experts) << "layer " << l;
  }
}

void ExpectBitwiseEqual(const Trained& a, const Trained& b) {
  ASSERT_EQ(a.steps.size(), b.steps.size());
  for (size_t i = 0; i < a.steps.size(); ++i) {
    EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << "step " << i;
    EXPECT_EQ(a.steps[i].aux_loss, b.steps[i].aux_loss) << "step " << i;
    EXPECT_EQ(a.steps[i].grad_norm, b.steps[i].grad_norm) << "step " << i;
  }
  for (const auto& [name, t] : a.params) {
    ASSERT_TRUE(b.params.count(name)) << name;
    EXPECT_TRUE(at::equal(t, b.params.at(name))) << name;
  }
}

TEST(ExpertCacheTwin, FullTrainingEqualsTheRunWithoutIt) {
  const launch::RunConfig run = Small({"experts.backend=eager"});
  const Trained plain = Train(run, false);
  const Trained cached = Train(run, true);
  ExpectBitwiseEqual(plain, cached);
  ExpectTheCacheWorked(cached);
  for (const StepStats& s : plain.steps) EXPECT_FALSE(s.gpu_cache);
}

TEST(ExpertCacheTwin, BfloatExpertsWithMastersEqualTheRunWithoutIt) {
  launch::RunConfig run = Small({"experts.backend=eager", "experts.dtype=bfloat16"});
  run.runtime.expert_master_weights = true;
  const Trained plain = Train(run, false);
  const Trained cached = Train(run, true);
  ExpectBitwiseEqual(plain, cached);
  ExpectTheCacheWorked(cached);
}

TEST(ExpertCacheTwin, LoraOnAFrozenBaseEqualsTheRunWithoutIt) {
  const launch::RunConfig run =
      Small({"experts.backend=eager", "train.mode=lora", "lora.rank=4", "lora.alpha=8",
             "lora.target_modules=[q_proj,experts]", "optimizer.lr=1e-2"});
  const Trained plain = Train(run, false);
  // The frozen base stays on the cache's device between changes of the set:
  // moved in and out every step here.
  const Trained cached = Train(run, true, /*rotate=*/true);
  ExpectBitwiseEqual(plain, cached);
  ExpectTheCacheWorked(cached);
  EXPECT_TRUE(plain.params.count("model.layers.1.mlp.experts.gate_up_proj.lora_A"));
}

// The grouped kernels on the host, eager on the twin: the same numbers to
// the two backends' rounding.
TEST(ExpertCacheTwin, GroupedHostAgreesToRounding) {
  const launch::RunConfig run = Small({});
  const Trained plain = Train(run, false);
  const Trained cached = Train(run, true);
  ASSERT_EQ(plain.steps.size(), cached.steps.size());
  for (size_t i = 0; i < plain.steps.size(); ++i) {
    EXPECT_NEAR(cached.steps[i].loss, plain.steps[i].loss, 1e-5 * plain.steps[i].loss);
    EXPECT_NEAR(cached.steps[i].grad_norm, plain.steps[i].grad_norm,
                1e-4 * plain.steps[i].grad_norm);
  }
  for (const auto& [name, t] : plain.params) {
    EXPECT_LT((cached.params.at(name) - t).abs().max().item<double>(), 1e-5) << name;
  }
  ExpectTheCacheWorked(cached);
}

}  // namespace
}  // namespace moefit::framework
