// The start-up memory report: the activation estimate against a hand
// computation on a toy model small enough to redo on paper, the weight,
// gradient and AdamW figures of a built model, and VmHWM.
#include "launch/memory_report.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sstream>

#include "framework/model.h"
#include "launch/plan_command.h"
#include "parallel/local_communicator.h"
#include "tests/launch/toy_model.h"

namespace moefit::launch {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

framework::ModelOptions Toy() { return testing::ToyModel(); }

TEST(MemoryReport, ActivationEstimateByHand) {
  const framework::ModelOptions o = Toy();
  // Dense floats per token (as plan_test.cc): attention 2*64 + (64 + 32 + 32 +
  // 64) + 64 = 384 per layer; MoE MLP 2*64 + 10 + 2*64 = 266, dense MLP 2*64 +
  // 3*96 = 416; final norm 64 and logits with their gradient 2*300.
  const int64_t floats = 3 * 384 + 2 * 266 + 416 + 64 + 600;
  EXPECT_EQ(DenseActivationFloatsPerToken(o), floats);
  // 2 sequences of 8 tokens: 16 tokens in fp32, then 2 MoE layers x 16 tokens
  // x top-2 rows of H + 2I = 128 elements.
  EXPECT_EQ(ActivationBytesEstimate(o, at::kBFloat16, 2, 8),
            16 * floats * 4 + 2 * 16 * 2 * 128 * 2);
  EXPECT_EQ(ActivationBytesEstimate(o, at::kFloat, 2, 8), 16 * floats * 4 + 2 * 16 * 2 * 128 * 4);
  // Linear in the tokens of the micro-batch.
  EXPECT_EQ(ActivationBytesEstimate(o, at::kFloat, 4, 8),
            2 * ActivationBytesEstimate(o, at::kFloat, 2, 8));
}

TEST(MemoryReport, WeightsGradientsAndAdamStatesOfABuiltModel) {
  framework::ModelRuntime runtime;
  runtime.expert_dtype = at::kBFloat16;
  auto model = framework::MoeModel::Create(Toy(), runtime, /*seed=*/0,
                                           framework::WeightInit::kUninitialized);
  ASSERT_TRUE(model.ok()) << model.status();
  const MemoryBreakdown m = ComputeMemoryBreakdown(**model, 2, 8);
  // fp32 dense: embeddings and LM head 2 x 300 x 64; per layer norms 2 x 64,
  // q 64 x 64, k and v 32 x 64, o 64 x 64, q/k norms 2 x 16; routers 10 x 64
  // in the 2 MoE layers; the dense MLP 3 x 96 x 64; the final norm 64.
  const int64_t dense = 2 * 300 * 64 + 3 * (2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 2 * 16) +
                        2 * 10 * 64 + 3 * 96 * 64 + 64;
  // bf16 experts: per MoE layer 10 x (gate_up 64 x 64 + down 64 x 32).
  const int64_t experts = 2 * 10 * (64 * 64 + 64 * 32);
  EXPECT_EQ(m.weight_bytes, dense * 4 + experts * 2);
  EXPECT_EQ(m.host_weight_bytes, m.weight_bytes);  // a CPU model
  EXPECT_EQ(m.gradient_bytes, m.weight_bytes);     // no buffers: every tensor trains
  EXPECT_EQ(m.optimizer_bytes, 2 * m.weight_bytes);
  EXPECT_EQ(m.activation_bytes, ActivationBytesEstimate(Toy(), at::kBFloat16, 2, 8));
  EXPECT_GT(m.peak_rss_bytes, 0);

  std::ostringstream log;
  LogMemoryBreakdown(m, *parallel::LocalCommunicator::Create(), 2, 8, log);
  // 627840 bytes.
  EXPECT_NE(log.str().find("memory of rank 0: weights 0.6 MiB (0.6 MiB in host RAM), gradients "
                           "0.6 MiB, AdamW m+v 1.2 MiB"),
            std::string::npos)
      << log.str();
  EXPECT_NE(log.str().find("per micro-batch of 2 x 8 tokens"), std::string::npos) << log.str();
  EXPECT_EQ(log.str().find("largest over"), std::string::npos) << "one rank";
  const MemoryBreakdown same = MaxOverRanks(m, *parallel::LocalCommunicator::Create());
  EXPECT_EQ(same.weight_bytes, m.weight_bytes);
  EXPECT_EQ(same.peak_rss_bytes, m.peak_rss_bytes);
}

// The routed experts' bytes per parameter, as stored: 2 for bfloat16; for
// int4 half a byte and a bfloat16 scale per 32 inputs, 0.5625 here.
TEST(MemoryReport, ExpertBytesPerParameter) {
  const int64_t params = 2 * 10 * 3 * 64 * 32;  // 2 MoE layers x 10 experts x 3 H I
  framework::ModelRuntime runtime;
  runtime.frozen_base = true;
  runtime.expert_dtype = at::kBFloat16;
  auto bf16 = framework::MoeModel::Create(Toy(), runtime, /*seed=*/0,
                                          framework::WeightInit::kUninitialized);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  ExpertMemory m = ComputeExpertMemory(**bf16);
  EXPECT_EQ(m.num_params, params);
  EXPECT_EQ(m.tensor_bytes, 2 * params);
  EXPECT_EQ(m.pack_bytes, 0);  // nothing has run

  runtime.expert_dtype = at::kByte;
  auto int4 = framework::MoeModel::Create(Toy(), runtime, /*seed=*/0,
                                          framework::WeightInit::kUninitialized);
  ASSERT_TRUE(int4.ok()) << int4.status();
  m = ComputeExpertMemory(**int4);
  EXPECT_EQ(m.num_params, params);
  // gate_up [64, 64]: 32 bytes + 2 scales a row; down [64, 32]: 16 bytes + 1 scale.
  EXPECT_EQ(m.tensor_bytes, 2 * 10 * (64 * (32 + 2 * 2) + 64 * (16 + 2)));
  EXPECT_EQ(m.tensor_bytes * 16, params * 9);

  std::ostringstream log;
  LogEndMemory(**int4, *parallel::LocalCommunicator::Create(), log);
  EXPECT_NE(log.str().find("moefit: memory at the end, rank 0: peak RSS "), std::string::npos)
      << log.str();
  EXPECT_NE(log.str().find("; routed experts 0.1 MiB + 0.0 MiB kept packs for 122880 parameters "
                           "(0.5625 + 0.0000 bytes each)"),
            std::string::npos)
      << log.str();
  EXPECT_EQ(log.str().find("largest over"), std::string::npos) << "one rank";
}

TEST(MemoryReport, PeakRssGrowsWithTouchedMemory) {
  absl::StatusOr<int64_t> before = PeakRssBytes();
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_GT(*before, 0);
  // Allocating is not enough: pages count once written.
  at::Tensor untouched = at::empty({256 * kMiB}, at::kByte);
  absl::StatusOr<int64_t> allocated = PeakRssBytes();
  ASSERT_TRUE(allocated.ok());
  EXPECT_LT(*allocated, *before + 64 * kMiB);
  untouched.fill_(1);
  absl::StatusOr<int64_t> touched = PeakRssBytes();
  ASSERT_TRUE(touched.ok());
  EXPECT_GE(*touched, *before + 200 * kMiB);
}

}  // namespace
}  // namespace moefit::launch
