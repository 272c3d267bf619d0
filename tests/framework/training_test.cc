// The model and trainer end to end on the shipped corpus: learning, exact
// determinism, eager vs grouped at the model level, accumulation invariance,
// every family building with its HF parameter names, and the deepseek_v3 and
// glm4_moe families learning.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

#include "framework/data.h"
#include "framework/model.h"
#include "framework/trainer.h"
#include "launch/config.h"
#include "launch/corpus.h"
#include "tests/framework/test_configs.h"

namespace moefit::framework {
namespace {

launch::RunConfig Demo(const std::vector<std::string>& sets) { return DemoRunConfig(sets); }

// With kept_packs, the bytes of packed expert weights the model keeps at the end.
std::vector<StepStats> Train(const launch::RunConfig& run, int64_t* kept_packs = nullptr) {
  auto data = TokenDataset::FromText(launch::ShippedCorpus(), run.seq_len, "corpus");
  EXPECT_TRUE(data.ok()) << data.status();
  auto model = MoeModel::Create(run.model, run.runtime, run.train.seed);
  EXPECT_TRUE(model.ok()) << model.status();
  Trainer trainer(**model, *data, run.train);
  std::ostringstream log;
  auto stats = trainer.Run(log);
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (kept_packs != nullptr) *kept_packs = (*model)->expert_pack_bytes();
  return *stats;
}

// The demo model, shortened: from ln(256) = 5.55 nats per byte it must reach
// below 2.9 in 60 steps (it gets to about 2.65 there; 2.9 is well above noise
// and well below the 3.3 that byte unigram statistics alone give).
TEST(Training, DemoModelLearnsTheCorpus) {
  launch::RunConfig run = Demo({"train.steps=60", "train.micro_batch_size=8",
                                "schedule.warmup_steps=6", "logging.metrics_file="});
  std::vector<StepStats> stats = Train(run);
  ASSERT_EQ(stats.size(), 60u);
  EXPECT_GT(stats.front().loss, 5.0);
  EXPECT_LT(stats.back().loss, 2.9);
  for (const StepStats& s : stats) {
    EXPECT_TRUE(std::isfinite(s.loss));
    EXPECT_GT(s.aux_loss, 1.0);  // HF balance loss: about top_k = 2 when balanced
    ASSERT_EQ(s.moe_layers.size(), 4u);
    int64_t total = 0;
    for (int64_t c : s.moe_layers[0].tokens_per_expert) total += c;
    EXPECT_EQ(total, 8 * 128 * 2);  // every token's top-2 assignments counted
    // The optimizer's share of the step is timed, within the step.
    EXPECT_GT(s.optimizer_seconds, 0.0);
    EXPECT_LT(s.optimizer_seconds + s.expert_seconds, s.seconds);
  }
}

TEST(Training, SameSeedSameLossSequence) {
  launch::RunConfig run = Demo({"train.steps=4", "train.micro_batch_size=2", "logging.metrics_file="});
  std::vector<StepStats> a = Train(run), b = Train(run);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].loss, b[i].loss) << "step " << i;
    EXPECT_EQ(a[i].grad_norm, b[i].grad_norm) << "step " << i;
  }
  run.train.seed += 1;
  EXPECT_NE(Train(run)[0].loss, a[0].loss);
}

// experts.packed_weight_gb reaches the expert kernels: under LoRA the default
// budget keeps the frozen experts' packs from the second step on, a budget of
// 0 keeps none; the packs give the bits of packing per call.
TEST(Training, PackedWeightBudgetReachesTheExpertKernels) {
  int64_t kept = 0, kept_none = -1;
  std::vector<std::string> sets = {"train.steps=3",
                                   "train.micro_batch_size=2",
                                   "logging.metrics_file=",
                                   "train.mode=lora",
                                   "lora.rank=4",
                                   "lora.alpha=8",
                                   "lora.target_modules=[all-linear,experts]"};
  const std::vector<StepStats> packed = Train(Demo(sets), &kept);
  sets.push_back("experts.packed_weight_gb=0");
  const std::vector<StepStats> per_call = Train(Demo(sets), &kept_none);
  EXPECT_GT(kept, 0);
  EXPECT_EQ(kept_none, 0);
  for (size_t i = 0; i < packed.size(); ++i) {
    EXPECT_EQ(packed[i].loss, per_call[i].loss) << "step " << i;
    EXPECT_EQ(packed[i].grad_norm, per_call[i].grad_norm) << "step " << i;
  }
}

TEST(Training, EagerAndGroupedBackendsGiveTheSameTrajectory) {
  launch::RunConfig run = Demo({"train.steps=3", "train.micro_batch_size=2", "logging.metrics_file="});
  std::vector<StepStats> grouped = Train(run);
  run.runtime.expert_backend = "eager";
  std::vector<StepStats> eager = Train(run);
  for (size_t i = 0; i < grouped.size(); ++i) {
    EXPECT_NEAR(grouped[i].loss, eager[i].loss, 1e-5 * eager[i].loss) << "step " << i;
    EXPECT_NEAR(grouped[i].grad_norm, eager[i].grad_norm, 1e-4 * eager[i].grad_norm);
  }
}

// The loss is normalized by the global batch's token count, so splitting the
// batch into micro-batches changes nothing (balance loss off: it is per
// micro-batch by definition, as in HF).
TEST(Training, GradientAccumulationEqualsOneLargeBatch) {
  launch::RunConfig run = Demo({"train.steps=2", "train.micro_batch_size=4",
                                "model.router_aux_loss_coef=0", "logging.metrics_file="});
  std::vector<StepStats> big = Train(run);
  run.train.micro_batch_size = 2;
  run.train.grad_accum_steps = 2;
  std::vector<StepStats> accum = Train(run);
  for (size_t i = 0; i < big.size(); ++i) {
    EXPECT_NEAR(big[i].loss, accum[i].loss, 1e-5 * big[i].loss) << "step " << i;
    EXPECT_NEAR(big[i].grad_norm, accum[i].grad_norm, 1e-4 * big[i].grad_norm) << "step " << i;
  }
}

TEST(Training, Bf16ExpertsTrain) {
  launch::RunConfig run = Demo({"train.steps=3", "train.micro_batch_size=2",
                                "experts.dtype=bfloat16", "logging.metrics_file="});
  std::vector<StepStats> s = Train(run);
  for (const StepStats& st : s) EXPECT_TRUE(std::isfinite(st.loss));
}

// train.dense_dtype = bfloat16: the dense layers under autocast (here the
// CPU's: the linear maps and attention take the path they take under a GPU's),
// float32 parameters. The loss tracks the float32 run within 2% per step, and
// is not the same (bfloat16 was used).
TEST(Training, Bf16DenseAutocastTracksFloat32) {
  launch::RunConfig run = Demo({"train.steps=8", "train.micro_batch_size=8",
                                "schedule.warmup_steps=2", "logging.metrics_file="});
  const std::vector<StepStats> fp32 = Train(run);
  run.train.dense_autocast = at::kBFloat16;
  auto model = MoeModel::Create(run.model, run.runtime, run.train.seed);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<StepStats> bf16 = TrainOnCorpus(**model, run);
  ASSERT_EQ(bf16.size(), fp32.size());
  bool differs = false;
  for (size_t i = 0; i < fp32.size(); ++i) {
    EXPECT_NEAR(bf16[i].loss, fp32[i].loss, 0.02 * fp32[i].loss) << "step " << i;
    differs |= bf16[i].loss != fp32[i].loss;
  }
  EXPECT_TRUE(differs);
  EXPECT_LT(bf16.back().loss, bf16.front().loss - 1.0);
  for (const Parameter& p : (*model)->trainable_parameters()) {
    EXPECT_EQ(p.tensor.scalar_type(), at::kFloat) << p.name;
  }
}

std::set<std::string> Names(const MoeModel& m) {
  std::set<std::string> names;
  for (const Parameter& p : m.parameters()) names.insert(p.name);
  return names;
}

TEST(Families, Qwen2MoeHasSharedExpertBiasesAndDenseLayers) {
  launch::RunConfig run = Demo({"model.model_type=qwen2_moe", "model.shared_expert_intermediate_size=64",
                                "model.mlp_only_layers=[1]"});
  auto model = MoeModel::Create(run.model, run.runtime, 0);
  ASSERT_TRUE(model.ok());
  std::set<std::string> n = Names(**model);
  EXPECT_TRUE(n.count("model.layers.0.self_attn.q_proj.bias"));
  EXPECT_TRUE(n.count("model.layers.0.mlp.shared_expert.gate_proj.weight"));
  EXPECT_TRUE(n.count("model.layers.0.mlp.shared_expert_gate.weight"));
  EXPECT_TRUE(n.count("model.layers.1.mlp.gate_proj.weight"));
  EXPECT_FALSE(n.count("model.layers.0.self_attn.q_norm.weight"));
  ForwardResult out = (*model)->Forward(at::randint(256, {2, 16}, at::kLong));
  EXPECT_EQ(out.logits.sizes(), (std::vector<int64_t>{2, 16, 256}));
  EXPECT_EQ(out.moe_layers.size(), 3u);
  LossSum l = CausalLmLossSum(out.logits, at::randint(256, {2, 16}, at::kLong));
  l.sum.backward();
  for (const Parameter& p : (*model)->parameters()) {
    EXPECT_TRUE(p.tensor.grad().defined()) << p.name;
  }
}

TEST(Families, MixtralAndQwen3Names) {
  launch::RunConfig run = Demo({"model.model_type=mixtral", "model.tie_word_embeddings=true"});
  auto model = MoeModel::Create(run.model, run.runtime, 0);
  ASSERT_TRUE(model.ok());
  std::set<std::string> n = Names(**model);
  EXPECT_TRUE(n.count("model.layers.3.mlp.experts.gate_up_proj"));
  EXPECT_TRUE(n.count("model.layers.3.mlp.experts.down_proj"));
  EXPECT_TRUE(n.count("model.layers.3.mlp.gate.weight"));
  EXPECT_FALSE(n.count("lm_head.weight"));  // tied
  EXPECT_FALSE(n.count("model.layers.0.self_attn.q_norm.weight"));
  launch::RunConfig q3 = Demo({});
  auto m3 = MoeModel::Create(q3.model, q3.runtime, 0);
  ASSERT_TRUE(m3.ok());
  EXPECT_TRUE(Names(**m3).count("model.layers.0.self_attn.q_norm.weight"));
  EXPECT_TRUE(Names(**m3).count("lm_head.weight"));
}

// The demo's shape as deepseek_v3 (multi-head latent attention with the query
// bottleneck, sigmoid routing in 4 groups, a shared expert, a dense first
// layer, the sequence-wise balance loss) and as glm4_moe.
std::vector<std::string> DeepseekSets() {
  return {"model.model_type=deepseek_v3", "model.router_aux_loss_coef=0", "model.q_lora_rank=64",
          "model.kv_lora_rank=32", "model.qk_nope_head_dim=32", "model.qk_rope_head_dim=16",
          "model.v_head_dim=32", "model.n_group=4", "model.topk_group=2",
          "model.first_k_dense_replace=1", "model.aux_loss_alpha=0.001"};
}
std::vector<std::string> Glm4Sets() {
  return {"model.model_type=glm4_moe", "model.router_aux_loss_coef=0", "model.attention_bias=true",
          "model.use_qk_norm=true", "model.n_group=2", "model.topk_group=1",
          "model.first_k_dense_replace=1", "model.aux_loss_alpha=0.001"};
}

TEST(Families, DeepseekV3AndGlm4MoeNamesAndBuffers) {
  for (bool q_lora : {true, false}) {
    std::vector<std::string> sets = DeepseekSets();
    if (!q_lora) sets.push_back("model.q_lora_rank=0");
    launch::RunConfig run = Demo(sets);
    auto model = MoeModel::Create(run.model, run.runtime, 0);
    ASSERT_TRUE(model.ok()) << model.status();
    std::set<std::string> n = Names(**model);
    EXPECT_EQ(n.count("model.layers.0.self_attn.q_a_proj.weight"), q_lora ? 1u : 0u);
    EXPECT_EQ(n.count("model.layers.0.self_attn.q_a_layernorm.weight"), q_lora ? 1u : 0u);
    EXPECT_EQ(n.count("model.layers.0.self_attn.q_proj.weight"), q_lora ? 0u : 1u);
    EXPECT_TRUE(n.count("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"));
    EXPECT_TRUE(n.count("model.layers.0.self_attn.kv_a_layernorm.weight"));
    EXPECT_TRUE(n.count("model.layers.0.self_attn.kv_b_proj.weight"));
    EXPECT_TRUE(n.count("model.layers.0.mlp.gate_proj.weight"));  // dense first layer
    EXPECT_TRUE(n.count("model.layers.1.mlp.shared_experts.down_proj.weight"));
    EXPECT_FALSE(n.count("model.layers.1.mlp.shared_expert_gate.weight"));  // ungated
    ASSERT_EQ((*model)->buffers().size(), 3u);  // one correction bias per MoE layer
    EXPECT_EQ((*model)->buffers()[0].name, "model.layers.1.mlp.gate.e_score_correction_bias");
    EXPECT_FALSE((*model)->buffers()[0].tensor.requires_grad());
  }
  launch::RunConfig run = Demo(Glm4Sets());
  EXPECT_DOUBLE_EQ(run.model.partial_rotary_factor, 0.5);
  auto model = MoeModel::Create(run.model, run.runtime, 0);
  ASSERT_TRUE(model.ok()) << model.status();
  std::set<std::string> n = Names(**model);
  EXPECT_TRUE(n.count("model.layers.0.self_attn.q_proj.bias"));
  EXPECT_TRUE(n.count("model.layers.0.self_attn.k_norm.weight"));
  EXPECT_FALSE(n.count("model.layers.0.self_attn.o_proj.bias"));
  EXPECT_TRUE(n.count("model.layers.3.mlp.shared_experts.gate_proj.weight"));
  EXPECT_EQ((*model)->buffers().size(), 3u);
}

// Both new families learn the corpus: from ln(256) = 5.55 nats per byte to
// below 3.3 in 40 steps (the unigram statistics of bytes alone give 3.3);
// measured 2.61 (deepseek_v3) and 2.94 (glm4_moe). The correction biases move.
TEST(Families, DeepseekV3AndGlm4MoeLearnTheCorpus) {
  for (const auto& sets : {DeepseekSets(), Glm4Sets()}) {
    std::vector<std::string> all = sets;
    for (const char* s : {"train.steps=40", "train.micro_batch_size=8", "schedule.warmup_steps=4",
                          "logging.metrics_file=", "router.bias_update_rate=0.001"}) {
      all.push_back(s);
    }
    launch::RunConfig run = Demo(all);
    auto data = TokenDataset::FromText(launch::ShippedCorpus(), run.seq_len, "corpus");
    auto model = MoeModel::Create(run.model, run.runtime, run.train.seed);
    ASSERT_TRUE(model.ok()) << model.status();
    Trainer trainer(**model, *data, run.train);
    std::ostringstream log;
    auto stats = trainer.Run(log);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_GT(stats->front().loss, 5.0) << run.model.model_type;
    EXPECT_LT(stats->back().loss, 3.3) << run.model.model_type;
    // The sequence-wise loss sums the 3 MoE layers' losses, each 1 when balanced.
    EXPECT_GT(stats->back().aux_loss, 1.5) << run.model.model_type;
    std::printf("%s: loss %.4f -> %.4f, sequence balance loss %.4f -> %.4f\n",
                run.model.model_type.c_str(), stats->front().loss, stats->back().loss,
                stats->front().aux_loss, stats->back().aux_loss);
    const at::Tensor bias = (*model)->buffers()[0].tensor;
    EXPECT_GT(bias.abs().max().item<double>(), 0.0) << run.model.model_type;
    EXPECT_LE(bias.abs().max().item<double>(), 40 * 0.001 + 1e-6) << run.model.model_type;
  }
}

TEST(Schedule, WarmupThenCosine) {
  TrainOptions o;
  o.steps = 11;
  o.optimizer.lr = 1.0;
  o.schedule.warmup_steps = 2;
  o.schedule.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 0), 0.5);
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 1), 1.0);
  EXPECT_DOUBLE_EQ(ScheduledLr(o, 2), 1.0);       // start of decay
  EXPECT_NEAR(ScheduledLr(o, 6), 0.55, 1e-12);    // halfway: (1 + 0.1) / 2
  EXPECT_NEAR(ScheduledLr(o, 10), 0.1, 1e-12);    // last step: min
}

TEST(Data, JsonlPacksAndMasks) {
  const std::string path = ::testing::TempDir() + "/d.jsonl";
  {
    std::ofstream f(path);
    f << R"({"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]})" << "\n\n"
      << R"({"input_ids": [5, 6, 7, 8]})" << "\n";
  }
  // Samples longer than a row are cut into pieces of 3, packed first fit:
  // [1 2 3] [4] [5 6 7] [8] -> rows [1 2 3], [4 8 pad], [5 6 7]. More in
  // packing_test.cc.
  auto d = TokenDataset::FromJsonl(path, 3, 10);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->num_sequences(), 3);
  Batch b = d->Gather({0, 1, 2});
  EXPECT_TRUE(
      at::equal(b.input_ids, at::tensor({1, 2, 3, 4, 8, 0, 5, 6, 7}, at::kLong).view({3, 3})));
  EXPECT_TRUE(at::equal(b.labels, at::tensor({-100, -100, 3, -100, -100, -100, -100, 6, 7},
                                             at::kLong).view({3, 3})));
  EXPECT_EQ(CountTrainedTokens(b.labels), 3);  // 3 of row 0, 6 and 7 of row 2
}

}  // namespace
}  // namespace moefit::framework
