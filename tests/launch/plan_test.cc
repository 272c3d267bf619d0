// The memory formulas of `moefit plan`, each checked against a hand
// computation on a toy model small enough to redo on paper; the node-count
// search; and the input checks. The shipped full-size configs are checked
// against transformers in tests/interop/test_plan.py.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <utility>
#include <vector>

#include "launch/plan_command.h"
#include "tests/launch/toy_model.h"

namespace moefit::launch {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

framework::ModelOptions Toy() { return testing::ToyModel(); }

PlanInputs Cluster(PlanMode mode, PlanDtype dtype) {
  PlanInputs in;
  in.nodes = 4;
  in.ram_gib = 64;
  in.gpus_per_node = 2;
  in.gpu_gib = 16;
  in.mode = mode;
  in.expert_dtype = dtype;
  in.lora_rank = 4;
  in.seq_len = 8;
  in.micro_batch = 1;
  return in;
}

TEST(Plan, FullModeByHand) {
  const framework::ModelOptions o = Toy();
  const Plan p = ComputePlan(o, Cluster(PlanMode::kFull, PlanDtype::kBf16));
  ASSERT_EQ(p.params.num_moe_layers, 2);
  ASSERT_EQ(p.params.per_expert, 3 * 64 * 32);
  // ceil(10 / 4) = 3 experts of each of the 2 MoE layers on the largest node.
  EXPECT_EQ(p.ram.experts_per_layer, 3);
  const int64_t slots = 3 * 2;
  // bf16 experts train beside fp32 masters, with fp32 gradients and m, v.
  EXPECT_EQ(p.ram.expert_weights, slots * 6144 * (2 + 4));
  EXPECT_EQ(p.ram.expert_grads, slots * 6144 * 4);
  EXPECT_EQ(p.ram.expert_optimizer, 2 * slots * 6144 * 4);
  EXPECT_EQ(p.ram.lora, 0);
  // 2 GPUs x 1 x 8 tokens per node, each picking 2 experts: 32 rows per MoE
  // layer, each keeping H + 2I = 128 bf16 elements.
  EXPECT_EQ(p.tokens_per_node, 16);
  EXPECT_EQ(p.rows_per_node, 32);
  EXPECT_EQ(p.ram.activations, 2 * 32 * 128 * 2);
  EXPECT_EQ(p.ram.reserve, 32 * kGiB);
  EXPECT_EQ(p.ram.total, slots * 6144 * 18 + p.ram.activations + p.ram.reserve);

  // Dense part in fp32 with gradients and AdamW m, v.
  EXPECT_EQ(p.gpu.dense_weights, p.params.dense * 4);
  EXPECT_EQ(p.gpu.dense_grads, p.params.dense * 4);
  EXPECT_EQ(p.gpu.dense_optimizer, p.params.dense * 8);
  // Floats per token: attention 2*64 + (64 + 32 + 32 + 64) + 64 = 384 per
  // layer; MoE MLP 2*64 + 10 + 2*64 = 266, dense MLP 2*64 + 3*96 = 416; final
  // norm 64 and logits with their gradient 2*300.
  const int64_t floats = 3 * 384 + 2 * 266 + 416 + 64 + 600;
  EXPECT_EQ(p.gpu.activations, 8 * floats * 4);
  EXPECT_EQ(p.gpu.reserve, 4 * kGiB);

  // 16 tokens go to each of the 3 other nodes unless both their experts miss
  // its 2.5 of 10 (probability 7.5/10 x 6.5/9): 22 token rows, sent in bf16
  // and returned in fp32, forward and backward, in 2 layers.
  EXPECT_EQ(p.alltoall_bytes_per_node,
            std::llround(2 * 16 * 3 * (1 - 0.75 * 6.5 / 9) * 64 * 2 * (2 + 4)));
  EXPECT_EQ(p.trainable_params, p.params.total);
  EXPECT_TRUE(p.fits);
  EXPECT_EQ(p.min_nodes, 1);
}

TEST(Plan, LoraFp8ByHand) {
  const framework::ModelOptions o = Toy();
  const Plan p = ComputePlan(o, Cluster(PlanMode::kLora, PlanDtype::kFp8));
  // 1 byte per weight + an fp32 scale per 128x128 block of each of the three
  // matrices (one block each here).
  EXPECT_EQ(p.ram.expert_weights, 6 * (6144 + 3 * 4));
  EXPECT_EQ(p.ram.expert_grads, 0);
  EXPECT_EQ(p.ram.expert_optimizer, 0);
  // Rank 4 on the fused gate|up (64 -> 2 * 32) and on down (32 -> 64), as
  // training adapts them: 4 * (64 + 64) + 4 * (32 + 64) = 896 parameters per
  // expert, 16 bytes each.
  EXPECT_EQ(p.lora_params_per_expert, 4 * (64 + 64) + 4 * (32 + 64));
  EXPECT_EQ(p.ram.lora, 6 * 896 * 16);
  // fp8 experts compute in bf16.
  EXPECT_EQ(p.ram.activations, 2 * 32 * 128 * 2);
  // Frozen bf16 dense part; rank 4 on q (64 -> 64), k, v (64 -> 32), o (64 -> 64) of 3 layers.
  EXPECT_EQ(p.gpu.dense_weights, p.params.dense * 2);
  EXPECT_EQ(p.gpu.dense_grads + p.gpu.dense_optimizer, 0);
  EXPECT_EQ(p.lora_params_attention, 3 * 4 * (128 + 96 + 96 + 128));
  EXPECT_EQ(p.gpu.lora, p.lora_params_attention * 16);
  EXPECT_EQ(p.trainable_params, 2 * 10 * 896 + p.lora_params_attention);
}

// int4 as compressed-tensors stores it: each row's weights in whole 32-bit
// words of eight, and a bf16 scale per 32 inputs: 0.5625 bytes per weight
// where the rows fill whole words and groups.
TEST(Plan, LoraInt4ByHand) {
  framework::ModelOptions o = Toy();
  const Plan p = ComputePlan(o, Cluster(PlanMode::kLora, PlanDtype::kInt4));
  EXPECT_EQ(p.int4_group_size, 32);
  // gate and up [32, 64]: 32 bytes + 2 scales of 2 bytes per row; down
  // [64, 32]: 16 bytes + 1 scale per row.
  const int64_t per_expert = 2 * 32 * (32 + 4) + 64 * (16 + 2);
  EXPECT_EQ(per_expert, 6144 * 9 / 16);
  EXPECT_EQ(p.ram.expert_weights, 6 * per_expert);
  EXPECT_EQ(p.ram.expert_grads + p.ram.expert_optimizer, 0);
  EXPECT_EQ(p.ram.lora, 6 * 896 * 16);
  // int4 experts compute in bf16, like fp8 ones.
  EXPECT_EQ(p.ram.activations, 2 * 32 * 128 * 2);
  EXPECT_EQ(p.gpu.dense_weights, p.params.dense * 2);

  // Rows that fill neither whole words nor whole groups: gate and up [36, 60]
  // take 8 words (32 bytes) and 2 scales per row, down [60, 36] 5 words
  // (20 bytes) and 2 scales.
  o.hidden_size = 60;
  o.moe_intermediate_size = 36;
  EXPECT_EQ(ComputePlan(o, Cluster(PlanMode::kLora, PlanDtype::kInt4)).ram.expert_weights,
            6 * (2 * 36 * (32 + 4) + 60 * (20 + 4)));
}

// The group size: --int4-group-size, else the checkpoint's
// quantization_config (with an int8 zero point per group when asymmetric),
// else 32.
TEST(Plan, Int4GroupSizeFromTheConfigOrTheFlag) {
  framework::ModelOptions o = Toy();
  o.int4_weights = checkpoint::PackedInt4Format{.group_size = 16, .symmetric = false};
  PlanInputs in = Cluster(PlanMode::kLora, PlanDtype::kInt4);
  Plan p = ComputePlan(o, in);
  EXPECT_EQ(p.int4_group_size, 16);
  // gate and up: 32 bytes + 4 groups of 3 bytes per row; down: 16 + 2 x 3.
  EXPECT_EQ(p.ram.expert_weights, 6 * (2 * 32 * (32 + 12) + 64 * (16 + 6)));
  in.int4_group_size = 64;
  p = ComputePlan(o, in);
  EXPECT_EQ(p.int4_group_size, 64);
  EXPECT_EQ(p.ram.expert_weights, 6 * (2 * 32 * (32 + 3) + 64 * (16 + 3)));
  // Not int4: no group size.
  EXPECT_EQ(ComputePlan(o, Cluster(PlanMode::kLora, PlanDtype::kFp8)).int4_group_size, 0);
}

// The expert kernels' kept packs of the frozen base: each of a node's 2
// processes holds ceil(3 / 2) = 2 experts of each MoE layer, and packs each
// layer's gate|up (64 x 64 per expert) and down (32 x 64) in the forward's
// orientation and again in dX's, while they fit its budget.
TEST(Plan, KeptPacksByHand) {
  const framework::ModelOptions o = Toy();
  PlanInputs in = Cluster(PlanMode::kLora, PlanDtype::kBf16);
  Plan p = ComputePlan(o, in);
  EXPECT_EQ(p.ram.experts_per_process, 2);
  // amx_bf16 keeps bf16 weights as bf16 pairs: 2 bytes each; 2 layers, 2
  // orientations, 2 processes.
  const int64_t per_layer = 2 * (64 * 64 + 32 * 64);
  EXPECT_EQ(p.ram.expert_packs, 2 * 2 * 2 * per_layer * 2);
  EXPECT_EQ(p.ram.total, p.ram.expert_weights + p.ram.lora + p.ram.expert_packs +
                             p.ram.activations + p.ram.reserve);
  // int4 packs are bf16 pairs too; FP8 keeps its byte; float32 panels on
  // AVX2 and AVX-512F, for every dtype.
  in.expert_dtype = PlanDtype::kInt4;
  EXPECT_EQ(ComputePlan(o, in).ram.expert_packs, 8 * per_layer * 2);
  in.expert_dtype = PlanDtype::kFp8;
  EXPECT_EQ(ComputePlan(o, in).ram.expert_packs, 8 * per_layer * 1);
  for (PlanIsa isa : {PlanIsa::kAvx2, PlanIsa::kAvx512}) {
    in.cpu_isa = isa;
    EXPECT_EQ(ComputePlan(o, in).ram.expert_packs, 8 * per_layer * 4);
  }
  in.expert_dtype = PlanDtype::kBf16;
  in.cpu_isa = PlanIsa::kAvx512Bf16;
  EXPECT_EQ(ComputePlan(o, in).ram.expert_packs, 8 * per_layer * 2);

  // A budget of 30000 bytes holds layer 0's forward packs (16384 + 8192);
  // nothing after them fits what is left.
  in.packed_weight_gib = 30000.0 / static_cast<double>(kGiB);
  EXPECT_EQ(ComputePlan(o, in).ram.expert_packs, 2 * (16384 + 8192));
  in.packed_weight_gib = 0;
  EXPECT_EQ(ComputePlan(o, in).ram.expert_packs, 0);
  // Trained weights are packed per call: full fine-tuning keeps none.
  EXPECT_EQ(ComputePlan(o, Cluster(PlanMode::kFull, PlanDtype::kBf16)).ram.expert_packs, 0);
}

TEST(Plan, MlaAttentionAdapters) {
  framework::ModelOptions o = Toy();
  o.attention = framework::AttentionKind::kMla;
  o.q_lora_rank = 24;
  o.kv_lora_rank = 16;
  o.qk_nope_head_dim = 8;
  o.qk_rope_head_dim = 4;
  o.v_head_dim = 8;
  PlanInputs in = Cluster(PlanMode::kLora, PlanDtype::kBf16);
  in.lora_rank = 2;
  const Plan p = ComputePlan(o, in);
  // q_a 64 -> 24, q_b 24 -> 4*12, kv_a 64 -> 16+4, kv_b 16 -> 4*(8+8), o 4*8 -> 64.
  const int64_t per_layer = 2 * ((64 + 24) + (24 + 48) + (64 + 20) + (16 + 64) + (32 + 64));
  EXPECT_EQ(p.lora_params_attention, 3 * per_layer);
  // Without query compression, one q_proj 64 -> 48 instead of q_a and q_b.
  o.q_lora_rank = 0;
  EXPECT_EQ(ComputePlan(o, in).lora_params_attention,
            3 * 2 * ((64 + 48) + (64 + 20) + (16 + 64) + (32 + 64)));
}

TEST(Plan, UnevenPlacementSizesTheLargestNode) {
  framework::ModelOptions o = Toy();
  for (auto [nodes, largest] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 10}, {3, 4}, {5, 2}, {6, 2}, {10, 1}, {16, 1}}) {
    PlanInputs in = Cluster(PlanMode::kFull, PlanDtype::kFp32);
    in.nodes = nodes;
    EXPECT_EQ(ComputePlan(o, in).ram.experts_per_layer, largest) << nodes << " nodes";
  }
  PlanInputs one = Cluster(PlanMode::kFull, PlanDtype::kFp32);
  one.nodes = 1;
  EXPECT_EQ(ComputePlan(o, one).alltoall_bytes_per_node, 0);  // nothing leaves a lone node
}

// The search finds the first node count whose largest node fits: with RAM
// just enough for ceil(64 / 4) = 16 experts per layer, 4 nodes (3 would need 22).
TEST(Plan, SmallestNodeCount) {
  framework::ModelOptions o = Toy();
  o.num_experts = 64;
  o.hidden_size = 1024;
  o.moe_intermediate_size = 2048;
  PlanInputs in = Cluster(PlanMode::kFull, PlanDtype::kBf16);
  in.nodes = 4;
  const int64_t need = ComputePlan(o, in).ram.total;
  in.nodes = 1;
  in.ram_gib = static_cast<double>(need) / static_cast<double>(kGiB) + 1e-9;
  Plan p = ComputePlan(o, in);
  EXPECT_FALSE(p.fits);
  EXPECT_FALSE(p.ram_fits);
  EXPECT_TRUE(p.gpu_fits);
  EXPECT_EQ(p.min_nodes, 4);

  // Less RAM than the reserve: no node count helps, and the reason says so.
  in.ram_gib = 16;
  p = ComputePlan(o, in);
  EXPECT_FALSE(p.min_nodes.has_value());
  EXPECT_NE(p.why_no_node_count.find("even one expert of each MoE layer per node"),
            std::string::npos)
      << p.why_no_node_count;

  // A GPU smaller than the dense part: no node count, whatever the RAM.
  in.ram_gib = 4096;
  in.gpu_gib = 1;
  p = ComputePlan(o, in);
  EXPECT_TRUE(p.ram_fits);
  EXPECT_FALSE(p.gpu_fits);
  EXPECT_FALSE(p.min_nodes.has_value());
  EXPECT_NE(p.why_no_node_count.find("does not fit one 1 GiB GPU at any node count"),
            std::string::npos)
      << p.why_no_node_count;
}

TEST(Plan, MostTokensPerGpu) {
  const framework::ModelOptions o = Toy();
  const Plan p = ComputePlan(o, Cluster(PlanMode::kFull, PlanDtype::kBf16));
  const int64_t per_token = p.gpu.activations / 8;
  const int64_t fixed = p.gpu.total - p.gpu.activations;
  EXPECT_EQ(p.max_tokens_per_gpu, (16 * kGiB - fixed) / per_token);
}

TEST(Plan, InputChecksNameTheFlag) {
  PlanInputs in = Cluster(PlanMode::kFull, PlanDtype::kFp8);
  absl::Status s = CheckPlanInputs(in);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "--expert-dtype fp8 needs --mode lora: FP8 expert weights can only be frozen");
  in.mode = PlanMode::kLora;
  EXPECT_TRUE(CheckPlanInputs(in).ok());
  in.seq_len = -1;
  EXPECT_EQ(CheckPlanInputs(in).message(), "--seq-len = -1 must be positive");
  in = Cluster(PlanMode::kFull, PlanDtype::kBf16);
  in.gpu_gib = -80;
  EXPECT_EQ(CheckPlanInputs(in).message(), "--gpu-gb = -80 must be positive");

  in = Cluster(PlanMode::kFull, PlanDtype::kInt4);
  EXPECT_EQ(CheckPlanInputs(in).message(),
            "--expert-dtype int4 needs --mode lora: int4 expert weights can only be frozen");
  in.mode = PlanMode::kLora;
  EXPECT_TRUE(CheckPlanInputs(in).ok());
  in.int4_group_size = 0;
  EXPECT_EQ(CheckPlanInputs(in).message(), "--int4-group-size = 0 must be between 1 and 65536");
  in.int4_group_size = 32;
  in.packed_weight_gib = -1;
  EXPECT_EQ(CheckPlanInputs(in).message(), "--packed-weight-gb = -1 must be between 0 and 1000000");
}

TEST(Plan, MissingConfigIsNotFound) {
  std::ostringstream out;
  absl::StatusOr<bool> r =
      RunPlan("/nonexistent/config.json", Cluster(PlanMode::kFull, PlanDtype::kBf16), false, out);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r.status().message(), "plan: --model: no such file '/nonexistent/config.json'");
}

}  // namespace
}  // namespace moefit::launch
