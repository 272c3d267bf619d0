// `moefit plan`: will this model train on this cluster, and on how few nodes?
//
// Sizes a run from an HF config.json alone, before anyone buys, books or
// waits for machines: no model is built and no tensor is allocated, so a
// trillion-parameter config plans in milliseconds. The layout is moefit's:
// every node holds num_experts / N of each MoE layer's routed experts in host
// RAM (contiguous blocks, the first nodes one more when N does not divide),
// shared by its processes, one per GPU; every GPU holds a replica of the dense
// part (attention, norms, routers, shared experts, dense MLPs, embeddings) and
// runs micro_batch x seq_len tokens.
//
// Every figure is one small named formula in plan_command.cc, written so that
// a reader can redo it by hand; the assumptions behind them are printed with
// the plan (PlanAssumptions) rather than hidden in constants.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "experts/kernels/isa.h"
#include "framework/model_options.h"

namespace moefit::launch {

// full: every weight is trained with AdamW. lora: the base weights are frozen
// and only rank-r adapters on the routed experts and attention projections train.
enum class PlanMode { kFull, kLora };
// Storage dtype of the routed experts. fp8 (e4m3 with an fp32 scale per
// 128x128 block, as DeepSeek-V3 and Kimi-K2 ship) and int4 (compressed-tensors'
// pack-quantized: 4-bit integers with a bfloat16 scale per group of inputs, as
// Kimi-K2-Thinking and Kimi-K2.5 ship) can only be frozen.
enum class PlanDtype { kFp32, kBf16, kFp8, kInt4 };

// --expert-dtype's names, in the enum's order: "fp32", "bf16", "fp8", "int4".
inline constexpr const char* kPlanDtypeNames[] = {"fp32", "bf16", "fp8", "int4"};
inline const char* PlanDtypeName(PlanDtype d) { return kPlanDtypeNames[static_cast<int>(d)]; }

// The expert kernels' instruction set on the nodes: it sets how large the
// kernels' kept packs of the frozen weights are. From avx512_bf16 up they
// multiply bfloat16 pairs, and a pack holds 2 bytes per bfloat16 or int4
// weight and 1 per FP8 one; below, float32 panels of 4 bytes. The portable
// kernels are not planned for.
using PlanIsa = experts::kernels::Isa;

struct PlanInputs {
  int64_t nodes = 0;
  double ram_gib = 0;  // host RAM per node
  int64_t gpus_per_node = 0;
  double gpu_gib = 0;  // memory per GPU
  PlanMode mode = PlanMode::kFull;
  int64_t lora_rank = 16;
  PlanDtype expert_dtype = PlanDtype::kBf16;
  int64_t seq_len = 4096;
  int64_t micro_batch = 1;  // sequences per GPU per micro-batch
  // int4 experts: inputs per bfloat16 scale; nullopt: the model config's
  // compressed-tensors quantization_config, else 32.
  std::optional<int64_t> int4_group_size;
  // experts.packed_weight_gb: GiB of packs each process's expert kernels keep.
  double packed_weight_gib = 2;
  PlanIsa cpu_isa = PlanIsa::kAmxBf16;
};

// InvalidArgument naming the flag when an input is out of range, or when fp8
// or int4 experts are asked to train (--mode full).
absl::Status CheckPlanInputs(const PlanInputs& in);

// Host RAM of the node holding the most experts.
struct NodeMemory {
  int64_t experts_per_layer = 0;    // routed experts of each MoE layer on this node
  int64_t experts_per_process = 0;  // of them, on the process holding the most
  int64_t expert_weights = 0;       // bytes, including fp8 and int4 scales
  int64_t expert_grads = 0;
  int64_t expert_optimizer = 0;  // AdamW m and v
  int64_t lora = 0;              // expert adapters: weights, grads, m and v (fp32)
  // The expert kernels' kept packs of the frozen weights (lora), all processes.
  int64_t expert_packs = 0;
  int64_t activations = 0;  // expert inputs and gate/up outputs kept for backward
  int64_t reserve = 0;
  int64_t total = 0;
};

// Memory of one GPU.
struct GpuMemory {
  int64_t dense_weights = 0;
  int64_t dense_grads = 0;
  int64_t dense_optimizer = 0;  // AdamW m and v
  int64_t lora = 0;             // attention adapters: weights, grads, m and v (fp32)
  int64_t activations = 0;      // dense activations kept for backward, and the logits
  int64_t reserve = 0;
  int64_t total = 0;
};

struct Plan {
  framework::ParameterCounts params;
  int64_t int4_group_size = 0;         // int4 experts: inputs per scale (0: not int4)
  int64_t lora_params_per_expert = 0;  // adapters of one routed expert (lora mode)
  int64_t lora_params_attention = 0;   // adapters on every attention projection, all layers
  int64_t trainable_params = 0;        // what AdamW updates
  int64_t tokens_per_node = 0;         // per micro-batch: gpus x micro_batch x seq_len
  int64_t rows_per_node = 0;           // expert rows a node computes per MoE layer
  NodeMemory ram;
  GpuMemory gpu;
  int64_t ram_capacity = 0;  // bytes
  int64_t gpu_capacity = 0;
  bool ram_fits = false;
  bool gpu_fits = false;
  bool fits = false;
  // Bytes a node sends per micro-batch (dispatch + combine, forward + backward).
  int64_t alltoall_bytes_per_node = 0;
  // Smallest node count at which the largest node's RAM fits, with the GPUs
  // fitting too; nullopt when none does (see why_no_node_count).
  std::optional<int64_t> min_nodes;
  std::string why_no_node_count;
  // Most micro_batch x seq_len tokens per GPU that fit its memory (0: none).
  int64_t max_tokens_per_gpu = 0;
};

// Floats per token the dense part keeps for backward (fp32, no recomputation;
// the formula is in PlanAssumptions). Also the start-up memory report's
// activation estimate (launch/memory_report.h).
int64_t DenseActivationFloatsPerToken(const framework::ModelOptions& model);

// The plan for `model` on the cluster `in` describes. Pure arithmetic.
Plan ComputePlan(const framework::ModelOptions& model, const PlanInputs& in);

// One line per assumption the formulas make, for the output and --help.
std::vector<std::string> PlanAssumptions();

// Reads `config_json` (an HF config.json), plans and prints the plan as text,
// or as one JSON object with `json`. Returns whether it fits; NotFound /
// InvalidArgument naming the file or flag on bad input.
absl::StatusOr<bool> RunPlan(const std::string& config_json, const PlanInputs& in, bool json,
                             std::ostream& out);

}  // namespace moefit::launch
