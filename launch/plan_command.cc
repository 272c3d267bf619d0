// The plan command; see plan_command.h.
//
// Each memory figure below is one named function of the model's shape and the
// cluster, with its formula in the comment above it. Sizes are bytes (int64:
// a 1T-parameter model's AdamW states are 1.6e13, far from 9.2e18).
#include "launch/plan_command.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/compressed_tensors.h"
#include "experts/expert_backend.h"
#include "launch/config.h"
#include "proto/config.pb.h"
#include "proto/status_macros.h"

namespace moefit::launch {
namespace {

namespace fs = std::filesystem;
using framework::ModelOptions;

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kFp32Bytes = 4;
constexpr int64_t kBf16Bytes = 2;
// FP8 checkpoints (DeepSeek-V3, Kimi-K2) carry one fp32 scale per block of
// kFp8Block x kFp8Block weights.
constexpr int64_t kFp8Block = 128;
// AdamW keeps two states, m and v, per trained weight.
constexpr int64_t kAdamStates = 2;
// A LoRA parameter is trained in fp32: weight, gradient, m and v.
constexpr int64_t kLoraBytesPerParam = 4 * kFp32Bytes;
// Host RAM no plan may use, per node: the OS, MPI and NCCL buffers, LibTorch
// and moefit's code, the dataset, some page cache for checkpoint reads.
constexpr int64_t kRamReserveGiB = 32;
// Per GPU: the CUDA context, cuBLAS and NCCL workspaces, the caching
// allocator's fragmentation.
constexpr int64_t kGpuReserveGiB = 4;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bytes per stored routed-expert weight of the byte-sized dtypes (fp8's
// block scales come on top; int4 is sized by Int4MatrixBytes).
int64_t WeightBytes(PlanDtype d) {
  return d == PlanDtype::kFp32 ? kFp32Bytes : d == PlanDtype::kBf16 ? kBf16Bytes : 1;
}

// Bytes per element of the rows the experts compute on (and the all-to-all
// carries): the experts' compute dtype, bf16 for fp8 and int4 weights
// (dequantized per tile).
int64_t ExpertActivationBytes(PlanDtype d) {
  return d == PlanDtype::kFp32 ? kFp32Bytes : kBf16Bytes;
}

// The node holding the most experts: moefit places experts in contiguous
// blocks, the first E mod N nodes owning one more, so ceil(E / N) per layer.
int64_t ExpertsOnLargestNode(int64_t num_experts, int64_t nodes) {
  return CeilDiv(num_experts, nodes);
}

// An int4 matrix [rows, cols] as moefit holds it (compressed-tensors'
// layout): each row's cols weights in ceil(cols / 8) 32-bit words, a bf16
// scale per group of `group` inputs, and for asymmetric schemes an int8 zero
// point per group.
int64_t Int4MatrixBytes(int64_t rows, int64_t cols, int64_t group, bool zero_points) {
  const int64_t per_group = kBf16Bytes + (zero_points ? 1 : 0);
  return rows * (experts::Int4RowBytes(cols) + checkpoint::NumInt4Groups(cols, group) * per_group);
}

// The group size int4 experts are planned with: --int4-group-size, else the
// model's compressed-tensors quantization_config, else the groups moefit
// quantizes random experts in (ModelRuntime::int4_group_size).
int64_t Int4GroupSize(const ModelOptions& o, const PlanInputs& in) {
  if (in.int4_group_size) return *in.int4_group_size;
  return o.int4_weights ? o.int4_weights->group_size : framework::ModelRuntime{}.int4_group_size;
}

// Whether int4 experts carry an int8 zero point per group (an asymmetric
// quantization_config); symmetric unless the model says otherwise.
bool Int4ZeroPoints(const ModelOptions& o) { return o.int4_weights && !o.int4_weights->symmetric; }

// One routed expert's stored bytes: gate and up [I, H] and down [H, I], so
// 3 * H * I weights, plus for fp8 an fp32 scale per 128x128 block of each,
// for int4 half a byte per weight and a bf16 scale (and for asymmetric
// schemes an int8 zero point) per group of inputs.
int64_t ExpertBytes(const ModelOptions& o, PlanDtype d, int64_t int4_group) {
  const int64_t h = o.hidden_size, i = o.moe_intermediate_size;
  if (d == PlanDtype::kInt4) {
    const bool zero_points = Int4ZeroPoints(o);
    return 2 * Int4MatrixBytes(i, h, int4_group, zero_points) +
           Int4MatrixBytes(h, i, int4_group, zero_points);
  }
  int64_t bytes = 3 * h * i * WeightBytes(d);
  if (d == PlanDtype::kFp8) bytes += 3 * CeilDiv(i, kFp8Block) * CeilDiv(h, kFp8Block) * kFp32Bytes;
  return bytes;
}

// Bytes per element of a kept pack of a weight [k x n] read by the kernels
// (experts/kernels/gemm.h, PackedB): float32 panels, except where the
// kernels multiply bfloat16 pairs, which keep bf16 and int4 weights as
// bfloat16 and FP8 ones as their bytes (when n is a multiple of 32 and k even).
int64_t PackBytesPerWeight(PlanDtype d, PlanIsa isa, int64_t k, int64_t n) {
  const bool pairs = experts::kernels::MultipliesInBf16(isa);
  if (!pairs || d == PlanDtype::kFp32) return kFp32Bytes;
  if (d == PlanDtype::kFp8 && n % 32 == 0 && k % 2 == 0) return 1;
  return kBf16Bytes;
}

// Bytes of packs one process's expert kernels keep (experts/packed_weights.h)
// of its frozen weights, `experts` routed experts in each MoE layer. A
// weight is packed whole (all its experts) in one orientation from its second
// step on, if it fits what is left of the budget: in the order of a step,
// each layer's gate|up and down as the forward reads them (Wᵀ), then, in
// backward, each layer's gate|up and down again as dX reads them (W).
// Trained weights are packed per call without recomputation, so full
// fine-tuning keeps none.
int64_t ExpertPacksPerProcess(const ModelOptions& o, const PlanInputs& in, int64_t experts,
                              int64_t num_moe_layers) {
  if (in.mode == PlanMode::kFull) return 0;
  const int64_t budget = std::llround(in.packed_weight_gib * static_cast<double>(kGiB));
  const int64_t h = o.hidden_size, i2 = 2 * o.moe_intermediate_size, i = o.moe_intermediate_size;
  auto pack = [&](int64_t k, int64_t n) {
    return experts * k * n * PackBytesPerWeight(in.expert_dtype, in.cpu_isa, k, n);
  };
  // Per layer: gate|up and down, forward (k = inputs of the GEMM) then backward.
  const int64_t forward[] = {pack(h, i2), pack(i, h)};
  const int64_t backward[] = {pack(i2, h), pack(h, i)};
  int64_t kept = 0;
  for (const int64_t* step : {forward, backward}) {
    for (int64_t l = 0; l < num_moe_layers; ++l) {
      for (int w = 0; w < 2; ++w) {
        if (kept + step[w] <= budget) kept += step[w];
      }
    }
  }
  return kept;
}

// A linear layer y = W x with W [out, in].
struct Linear {
  int64_t in, out;
};

// The projections of one attention layer (what LoRA adapts).
std::vector<Linear> AttentionProjections(const ModelOptions& o) {
  const int64_t h = o.hidden_size, heads = o.num_attention_heads;
  if (o.attention == framework::AttentionKind::kMla) {
    std::vector<Linear> p;
    const int64_t q_out = heads * o.qk_head_dim();
    if (o.q_lora_rank > 0) {
      p.push_back({h, o.q_lora_rank});      // q_a_proj
      p.push_back({o.q_lora_rank, q_out});  // q_b_proj
    } else {
      p.push_back({h, q_out});  // q_proj
    }
    p.push_back({h, o.kv_lora_rank + o.qk_rope_head_dim});  // kv_a_proj_with_mqa
    p.push_back({o.kv_lora_rank, heads * (o.qk_nope_head_dim + o.v_head_dim)});  // kv_b_proj
    p.push_back({heads * o.v_head_dim, h});                                      // o_proj
    return p;
  }
  const int64_t q = heads * o.head_dim, kv = o.num_key_value_heads * o.head_dim;
  return {{h, q}, {h, kv}, {h, kv}, {q, h}};
}

// LoRA of rank r on W [out, in]: A [r, in] and B [out, r].
int64_t LoraParams(int64_t r, const Linear& l) { return r * (l.in + l.out); }

// Adapters of one routed expert as moefit trains them (PEFT's target_parameters
// on the fused experts): one on gate|up (H -> 2I), one on down (I -> H).
int64_t LoraParamsPerExpert(const ModelOptions& o, int64_t r) {
  const int64_t h = o.hidden_size, i = o.moe_intermediate_size;
  return LoraParams(r, {h, 2 * i}) + LoraParams(r, {i, h});
}

// Adapters on every attention projection of every layer.
int64_t LoraParamsAttention(const ModelOptions& o, int64_t r) {
  int64_t per_layer = 0;
  for (const Linear& l : AttentionProjections(o)) per_layer += LoraParams(r, l);
  return o.num_hidden_layers * per_layer;
}

// Floats one token keeps for backward in one layer's attention block: the
// block input and its RMSNorm output (2H), every projection's output (q, k,
// v, the MLA latents; o_proj's output is the residual branch) and the
// attention output (o_proj's input). Memory-efficient attention keeps no
// seq_len x seq_len scores.
int64_t AttentionActivationFloats(const ModelOptions& o) {
  int64_t floats = 2 * o.hidden_size;
  for (const Linear& l : AttentionProjections(o)) floats += l.out;
  const int64_t head_out =
      o.attention == framework::AttentionKind::kMla ? o.v_head_dim : o.head_dim;
  return floats + o.num_attention_heads * head_out;
}

// ... and in its MLP block on the GPU: input and RMSNorm output (2H), then a
// dense MLP's gate, up and their product (3 x intermediate), or a MoE layer's
// shared experts (3 x their width), router scores (num_experts) and the
// top_k expert rows that come back before their weighted sum (top_k x H).
int64_t MlpActivationFloats(const ModelOptions& o, bool moe_layer) {
  const int64_t h = o.hidden_size;
  if (!moe_layer) return 2 * h + 3 * o.intermediate_size;
  const int64_t shared = o.shared_experts_intermediate_size() + o.shared_expert_intermediate_size;
  return 2 * h + 3 * shared + o.num_experts + o.num_experts_per_tok * h;
}

}  // namespace

// Every layer's attention and MLP blocks, the final norm's input (H), and the
// fp32 logits with their gradient (2 x vocab).
int64_t DenseActivationFloatsPerToken(const ModelOptions& o) {
  int64_t floats = o.hidden_size + 2 * o.vocab_size;
  for (int64_t l = 0; l < o.num_hidden_layers; ++l) {
    floats += AttentionActivationFloats(o) + MlpActivationFloats(o, o.IsMoeLayer(l));
  }
  return floats;
}

namespace {

// Expert rows one node computes per MoE layer and micro-batch: the
// N x tokens_per_node tokens of the cluster each pick top_k experts, spread
// evenly over the N nodes (balanced routing).
int64_t RowsPerNode(const ModelOptions& o, int64_t tokens_per_node) {
  return tokens_per_node * o.num_experts_per_tok;
}

// Host RAM of the node with the most experts, at `nodes` nodes.
NodeMemory NodeMemoryAt(const ModelOptions& o, const framework::ParameterCounts& c,
                        const PlanInputs& in, int64_t nodes, int64_t rows) {
  NodeMemory m;
  m.experts_per_layer = ExpertsOnLargestNode(o.num_experts, nodes);
  m.experts_per_process = CeilDiv(m.experts_per_layer, in.gpus_per_node);
  const int64_t slots = m.experts_per_layer * c.num_moe_layers;  // expert copies on the node
  m.expert_weights = slots * ExpertBytes(o, in.expert_dtype, Int4GroupSize(o, in));
  if (in.mode == PlanMode::kFull) {
    // As moefit trains them: gradients and AdamW states in float32, and
    // bfloat16 experts beside their float32 master weights (fp8 never trains).
    const int64_t fp32 = slots * c.per_expert * WeightBytes(PlanDtype::kFp32);
    if (in.expert_dtype != PlanDtype::kFp32) m.expert_weights += fp32;
    m.expert_grads = fp32;
    m.expert_optimizer = kAdamStates * fp32;
  } else {
    m.lora = slots * LoraParamsPerExpert(o, in.lora_rank) * kLoraBytesPerParam;
  }
  // Each of the node's processes (one per GPU) keeps packs of its share.
  m.expert_packs =
      in.gpus_per_node * ExpertPacksPerProcess(o, in, m.experts_per_process, c.num_moe_layers);
  // Per MoE layer each row keeps its input (H) and its gate/up outputs (2I).
  m.activations = c.num_moe_layers * rows * (o.hidden_size + 2 * o.moe_intermediate_size) *
                  ExpertActivationBytes(in.expert_dtype);
  m.reserve = kRamReserveGiB * kGiB;
  m.total = m.expert_weights + m.expert_grads + m.expert_optimizer + m.lora + m.expert_packs +
            m.activations + m.reserve;
  return m;
}

// Memory of one GPU; the same at any node count (every GPU holds the whole
// dense part and its own micro-batch).
GpuMemory GpuMemoryFor(const ModelOptions& o, const framework::ParameterCounts& c,
                       const PlanInputs& in) {
  GpuMemory g;
  if (in.mode == PlanMode::kFull) {
    // moefit trains the dense part in fp32: weights, gradients, m and v.
    g.dense_weights = c.dense * kFp32Bytes;
    g.dense_grads = c.dense * kFp32Bytes;
    g.dense_optimizer = kAdamStates * c.dense * kFp32Bytes;
  } else {
    g.dense_weights = c.dense * kBf16Bytes;  // frozen
    g.lora = LoraParamsAttention(o, in.lora_rank) * kLoraBytesPerParam;
  }
  g.activations = in.micro_batch * in.seq_len * DenseActivationFloatsPerToken(o) * kFp32Bytes;
  g.reserve = kGpuReserveGiB * kGiB;
  g.total =
      g.dense_weights + g.dense_grads + g.dense_optimizer + g.lora + g.activations + g.reserve;
  return g;
}

// Token rows one node sends to the others per MoE layer exchange, under
// balanced routing and the dispatch's deduplication: a token goes once to
// every other node that owns any of its top-k experts. A node owns E/N of
// the E experts, so k distinct experts miss it with probability
// prod_{i<k} (E - E/N - i) / (E - i).
double RemoteTokenRows(const ModelOptions& o, int64_t tokens_per_node, int64_t nodes) {
  const double e = static_cast<double>(o.num_experts), own = e / static_cast<double>(nodes);
  double miss = 1.0;
  for (int64_t i = 0; i < o.num_experts_per_tok; ++i) {
    miss *= std::max(0.0, e - own - static_cast<double>(i)) / (e - static_cast<double>(i));
  }
  return static_cast<double>(tokens_per_node) * static_cast<double>(nodes - 1) * (1.0 - miss);
}

// Bytes one node sends per micro-batch: those rows, H elements each, four
// times per MoE layer: dispatch (the experts' dtype) and combine (float32
// weighted sums) forward, and their gradients backward.
int64_t AllToAllBytesPerNode(const ModelOptions& o, const framework::ParameterCounts& c,
                             const PlanInputs& in, int64_t tokens_per_node) {
  // In double: rows x hidden x bytes can pass int64 at the input limits.
  const double per_row = static_cast<double>(o.hidden_size) *
                         static_cast<double>(2 * (ExpertActivationBytes(in.expert_dtype) + 4));
  return static_cast<int64_t>(std::llround(static_cast<double>(c.num_moe_layers) *
                                           RemoteTokenRows(o, tokens_per_node, in.nodes) *
                                           per_row));
}

std::string Count(double n) {
  if (n >= 1e12) return absl::StrFormat("%.3fT", n / 1e12);
  if (n >= 1e9) return absl::StrFormat("%.2fB", n / 1e9);
  if (n >= 1e6) return absl::StrFormat("%.2fM", n / 1e6);
  if (n >= 1e3) return absl::StrFormat("%.1fK", n / 1e3);
  return absl::StrFormat("%.0f", n);
}

double GiB(int64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(kGiB); }

std::string Line(const std::string& what, int64_t bytes) {
  return absl::StrFormat("  %-62s %10.2f\n", what, GiB(bytes));
}

nlohmann::json ToJson(const std::string& path, const ModelOptions& o, const PlanInputs& in,
                      const Plan& p) {
  nlohmann::json j;
  j["config"] = path;
  j["model_type"] = o.model_type;
  j["inputs"] = {{"nodes", in.nodes},
                 {"ram_gib", in.ram_gib},
                 {"gpus_per_node", in.gpus_per_node},
                 {"gpu_gib", in.gpu_gib},
                 {"mode", in.mode == PlanMode::kFull ? "full" : "lora"},
                 {"lora_rank", in.lora_rank},
                 {"expert_dtype", PlanDtypeName(in.expert_dtype)},
                 {"seq_len", in.seq_len},
                 {"micro_batch", in.micro_batch},
                 {"packed_weight_gb", in.packed_weight_gib},
                 {"cpu_isa", std::string(experts::kernels::IsaName(in.cpu_isa))}};
  if (in.expert_dtype == PlanDtype::kInt4) j["inputs"]["int4_group_size"] = p.int4_group_size;
  j["parameters"] = {{"total", p.params.total},
                     {"active", p.params.active},
                     {"routed_experts", p.params.routed_experts},
                     {"dense", p.params.dense},
                     {"embedding", p.params.embedding},
                     {"per_expert", p.params.per_expert},
                     {"num_moe_layers", p.params.num_moe_layers},
                     {"num_experts", o.num_experts},
                     {"top_k", o.num_experts_per_tok},
                     {"lora_per_expert", p.lora_params_per_expert},
                     {"lora_attention", p.lora_params_attention},
                     {"trainable", p.trainable_params}};
  j["tokens_per_node"] = p.tokens_per_node;
  j["rows_per_node"] = p.rows_per_node;
  j["ram_per_node"] = {{"experts_per_layer", p.ram.experts_per_layer},
                       {"experts_per_process", p.ram.experts_per_process},
                       {"expert_weights", p.ram.expert_weights},
                       {"expert_grads", p.ram.expert_grads},
                       {"expert_optimizer", p.ram.expert_optimizer},
                       {"lora", p.ram.lora},
                       {"expert_packs", p.ram.expert_packs},
                       {"activations", p.ram.activations},
                       {"reserve", p.ram.reserve},
                       {"total", p.ram.total},
                       {"capacity", p.ram_capacity},
                       {"fits", p.ram_fits}};
  j["gpu_per_gpu"] = {{"dense_weights", p.gpu.dense_weights},
                      {"dense_grads", p.gpu.dense_grads},
                      {"dense_optimizer", p.gpu.dense_optimizer},
                      {"lora", p.gpu.lora},
                      {"activations", p.gpu.activations},
                      {"reserve", p.gpu.reserve},
                      {"total", p.gpu.total},
                      {"capacity", p.gpu_capacity},
                      {"fits", p.gpu_fits}};
  j["alltoall_bytes_per_node"] = p.alltoall_bytes_per_node;
  j["fits"] = p.fits;
  j["min_nodes"] = p.min_nodes ? nlohmann::json(*p.min_nodes) : nlohmann::json(nullptr);
  if (!p.min_nodes) j["why_no_node_count"] = p.why_no_node_count;
  j["max_tokens_per_gpu"] = p.max_tokens_per_gpu;
  j["assumptions"] = PlanAssumptions();
  return j;
}

void PrintText(const std::string& path, const ModelOptions& o, const PlanInputs& in, const Plan& p,
               std::ostream& out) {
  const bool full = in.mode == PlanMode::kFull;
  const char* dtype = PlanDtypeName(in.expert_dtype);
  const framework::ParameterCounts& c = p.params;
  out << absl::StrFormat(
      "moefit plan: %s\n"
      "model: %s, %d layers (%d MoE), hidden %d, %d routed experts top-%d, expert width %d\n"
      "parameters: %s total, %s active per token; routed experts %s, dense part %s\n"
      "cluster: %d nodes x %g GiB RAM, %d GPUs x %g GiB per node; mode %s%s, experts %s;\n"
      "         %d x %d tokens per GPU = %d tokens per node per micro-batch\n"
      "trainable: %s parameters\n\n",
      path, o.model_type, o.num_hidden_layers, c.num_moe_layers, o.hidden_size, o.num_experts,
      o.num_experts_per_tok, o.moe_intermediate_size, Count(c.total), Count(c.active),
      Count(c.routed_experts), Count(c.dense), in.nodes, in.ram_gib, in.gpus_per_node, in.gpu_gib,
      full ? "full" : "lora", full ? "" : absl::StrCat(" rank ", in.lora_rank), dtype,
      in.micro_batch, in.seq_len, p.tokens_per_node, Count(p.trainable_params));

  out << absl::StrFormat("%-65s%10s\n",
                         absl::StrCat("host RAM per node (the largest: ", p.ram.experts_per_layer,
                                      " experts of each MoE layer)"),
                         "GiB");
  const bool masters = full && in.expert_dtype != PlanDtype::kFp32;
  std::string stored = dtype;
  if (masters) stored += " + fp32 masters";
  if (in.expert_dtype == PlanDtype::kFp8) stored += " + fp32 scale per 128x128";
  if (in.expert_dtype == PlanDtype::kInt4) {
    stored += absl::StrCat(" + bf16 scale", Int4ZeroPoints(o) ? " and int8 zero point" : "",
                           " per ", p.int4_group_size, " inputs");
  }
  out << Line(absl::StrCat("routed expert weights (", stored, ")"), p.ram.expert_weights);
  if (full) {
    out << Line("  their gradients (fp32)", p.ram.expert_grads);
    out << Line("  their AdamW m and v (fp32)", p.ram.expert_optimizer);
  } else {
    out << Line("LoRA adapters on the experts (fp32 weights, grads, m, v)", p.ram.lora);
    out << Line(absl::StrFormat("kernels' kept packs (%d x %d experts, %s, %g GiB)",
                                in.gpus_per_node, p.ram.experts_per_process,
                                experts::kernels::IsaName(in.cpu_isa), in.packed_weight_gib),
                p.ram.expert_packs);
  }
  out << Line(absl::StrFormat("expert activations for backward (%d rows x %d layers)",
                              p.rows_per_node, c.num_moe_layers),
              p.ram.activations);
  out << Line("fixed reserve", p.ram.reserve);
  out << absl::StrFormat("  %-62s %10.2f of %g: %s\n\n", "total", GiB(p.ram.total), in.ram_gib,
                         p.ram_fits ? "fits" : "DOES NOT FIT");

  out << absl::StrFormat("%-65s%10s\n", "memory per GPU", "GiB");
  out << Line(
      absl::StrCat("dense weights (", full ? "fp32" : "bf16, frozen", ", ", Count(c.dense), ")"),
      p.gpu.dense_weights);
  if (full) {
    out << Line("  their gradients (fp32)", p.gpu.dense_grads);
    out << Line("  their AdamW m and v (fp32)", p.gpu.dense_optimizer);
  } else {
    out << Line(absl::StrCat("LoRA adapters on attention (", Count(p.lora_params_attention),
                             ", fp32 weights, grads, m, v)"),
                p.gpu.lora);
  }
  out << Line(absl::StrFormat("activations for backward (%d x %d tokens, fp32)", in.micro_batch,
                              in.seq_len),
              p.gpu.activations);
  out << Line("fixed reserve", p.gpu.reserve);
  out << absl::StrFormat("  %-62s %10.2f of %g: %s\n\n", "total", GiB(p.gpu.total), in.gpu_gib,
                         p.gpu_fits ? "fits" : "DOES NOT FIT");

  out << absl::StrFormat(
      "all-to-all per node per micro-batch: %.2f GiB sent (%d layers x %.0f token rows to other "
      "nodes x %d x 2 x (%d + 4) bytes)\n\n",
      GiB(p.alltoall_bytes_per_node), c.num_moe_layers,
      RemoteTokenRows(o, p.tokens_per_node, in.nodes), o.hidden_size,
      ExpertActivationBytes(in.expert_dtype));

  out << "result: " << (p.fits ? "fits" : "does NOT fit");
  if (!p.fits) {
    std::vector<std::string> why;
    if (!p.ram_fits)
      why.push_back(absl::StrFormat("RAM %.1f > %g GiB", GiB(p.ram.total), in.ram_gib));
    if (!p.gpu_fits)
      why.push_back(absl::StrFormat("GPU %.1f > %g GiB", GiB(p.gpu.total), in.gpu_gib));
    out << " (" << absl::StrJoin(why, ", ") << ")";
  }
  out << "\n";
  if (p.min_nodes) {
    out << "smallest node count that fits: " << *p.min_nodes << "\n";
  } else {
    out << "smallest node count that fits: none; " << p.why_no_node_count << "\n";
  }
  if (p.max_tokens_per_gpu > 0) {
    out << absl::StrFormat("most tokens per GPU micro-batch (micro_batch x seq_len) that fit: %d\n",
                           p.max_tokens_per_gpu);
  } else {
    out << absl::StrFormat(
        "most tokens per GPU micro-batch that fit: none; %s alone need %.1f GiB\n",
        full ? "the dense weights, their states and the reserve"
             : "the frozen dense weights, LoRA and the reserve",
        GiB(p.gpu.total - p.gpu.activations));
  }
  out << "assumes:\n";
  for (const std::string& a : PlanAssumptions()) out << "  - " << a << "\n";
}

}  // namespace

absl::Status CheckPlanInputs(const PlanInputs& in) {
  auto positive = [](const char* flag, double v) -> absl::Status {
    if (v > 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(flag, " = ", v, " must be positive"));
  };
  MOEFIT_RETURN_IF_ERROR(positive("--nodes", static_cast<double>(in.nodes)));
  MOEFIT_RETURN_IF_ERROR(positive("--ram-gb", in.ram_gib));
  MOEFIT_RETURN_IF_ERROR(positive("--gpus-per-node", static_cast<double>(in.gpus_per_node)));
  MOEFIT_RETURN_IF_ERROR(positive("--gpu-gb", in.gpu_gib));
  MOEFIT_RETURN_IF_ERROR(positive("--lora-rank", static_cast<double>(in.lora_rank)));
  MOEFIT_RETURN_IF_ERROR(positive("--seq-len", static_cast<double>(in.seq_len)));
  MOEFIT_RETURN_IF_ERROR(positive("--micro-batch", static_cast<double>(in.micro_batch)));
  // A petabyte of RAM, a million nodes or a billion tokens per node is a
  // typo, and the limits keep the byte arithmetic far from int64 overflow.
  if (in.ram_gib > 1e6 || in.gpu_gib > 1e6 || in.nodes > 1'000'000 ||
      in.gpus_per_node > 1'000'000) {
    return absl::InvalidArgumentError(
        "--nodes, --gpus-per-node, --ram-gb or --gpu-gb is implausibly large (over a million)");
  }
  if (static_cast<double>(in.gpus_per_node) * static_cast<double>(in.micro_batch) *
          static_cast<double>(in.seq_len) >
      1e9) {
    return absl::InvalidArgumentError(
        "--gpus-per-node x --micro-batch x --seq-len is implausibly large (over a billion tokens "
        "per node)");
  }
  if (in.lora_rank > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("--lora-rank = ", in.lora_rank, " is implausibly large (over 65536)"));
  }
  if (in.expert_dtype == PlanDtype::kFp8 && in.mode == PlanMode::kFull) {
    return absl::InvalidArgumentError(
        "--expert-dtype fp8 needs --mode lora: FP8 expert weights can only be frozen");
  }
  if (in.expert_dtype == PlanDtype::kInt4 && in.mode == PlanMode::kFull) {
    return absl::InvalidArgumentError(
        "--expert-dtype int4 needs --mode lora: int4 expert weights can only be frozen");
  }
  if (in.int4_group_size && !(*in.int4_group_size > 0 && *in.int4_group_size <= 65536)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--int4-group-size = ", *in.int4_group_size, " must be between 1 and 65536"));
  }
  if (!(in.packed_weight_gib >= 0 && in.packed_weight_gib <= 1e6)) {
    return absl::InvalidArgumentError(absl::StrCat("--packed-weight-gb = ", in.packed_weight_gib,
                                                   " must be between 0 and 1000000"));
  }
  return absl::OkStatus();
}

std::vector<std::string> PlanAssumptions() {
  return {
      "GiB = 2^30 bytes; --ram-gb and --gpu-gb are read in GiB",
      "balanced routing: each node computes tokens x top_k / N expert rows per MoE layer "
      "(skew adds to the busiest node)",
      "full mode: experts in --expert-dtype, bf16 ones with fp32 master weights (18 bytes per "
      "expert parameter with fp32 gradients and AdamW m, v; 16 in fp32), the dense part in fp32 "
      "(16 bytes per parameter)",
      "lora mode: base weights frozen (dense part in bf16, experts in --expert-dtype); rank-r "
      "A and B on each routed expert's fused gate|up and on its down, and on every attention "
      "projection, in fp32 with gradients and AdamW m, v (16 bytes per adapter parameter)",
      "fp8 experts: 1 byte per weight + an fp32 scale per 128x128 block; int4 experts: "
      "half a byte per weight (rows padded to 8 weights) + a bf16 scale per group of inputs "
      "(--int4-group-size, else the config's quantization_config, else 32), and an int8 zero "
      "point per group where that config is asymmetric; both compute in bf16",
      "one process per GPU; each holds ceil(node's experts / GPUs) of every MoE layer, and its "
      "expert kernels keep packs of them up to --packed-weight-gb (experts.packed_weight_gb): "
      "in lora mode each frozen weight (one layer's gate|up or down, all the process's experts) "
      "in each orientation (forward, dX) that fits what is left, in the order a step uses them; "
      "2 bytes per weight where the kernels multiply bf16 pairs (avx512_bf16, amx_bf16; FP8 1 "
      "byte), else 4 (float32 panels); full mode keeps none (no recomputation)",
      "expert activations in the experts' compute dtype: per MoE layer each row keeps its "
      "input (hidden) and gate/up outputs (2 x moe_intermediate)",
      "dense activations in fp32, no recomputation, memory-efficient attention (no seq_len^2 "
      "scores); per token and layer: 2 x hidden + every attention projection's output + the "
      "attention output, then 2 x hidden + 3 x intermediate (dense MLP) or 3 x shared-expert "
      "width + num_experts + top_k x hidden (MoE); plus 2 x vocab for the logits and their "
      "gradient",
      "all-to-all: each token goes once to every other node owning any of its top_k experts "
      "(balanced routing), hidden elements in the experts' compute dtype there and in fp32 back "
      "(weighted sums), forward and backward",
      absl::StrCat("fixed reserve: ", kRamReserveGiB, " GiB of RAM per node (OS, MPI/NCCL, ",
                   "LibTorch, data), ", kGpuReserveGiB, " GiB per GPU (CUDA context, workspaces, ",
                   "allocator slack); transient per-layer buffers and multi-token-prediction ",
                   "layers are not counted"),
  };
}

Plan ComputePlan(const ModelOptions& o, const PlanInputs& in) {
  Plan p;
  p.params = framework::CountParameters(o);
  if (in.expert_dtype == PlanDtype::kInt4) p.int4_group_size = Int4GroupSize(o, in);
  p.lora_params_per_expert = LoraParamsPerExpert(o, in.lora_rank);
  p.lora_params_attention = LoraParamsAttention(o, in.lora_rank);
  p.trainable_params = in.mode == PlanMode::kFull
                           ? p.params.total
                           : p.params.num_moe_layers * o.num_experts * p.lora_params_per_expert +
                                 p.lora_params_attention;
  if (in.mode == PlanMode::kFull) p.lora_params_per_expert = p.lora_params_attention = 0;
  p.tokens_per_node = in.gpus_per_node * in.micro_batch * in.seq_len;
  p.rows_per_node = RowsPerNode(o, p.tokens_per_node);
  p.ram = NodeMemoryAt(o, p.params, in, in.nodes, p.rows_per_node);
  p.gpu = GpuMemoryFor(o, p.params, in);
  p.ram_capacity = std::llround(in.ram_gib * static_cast<double>(kGiB));
  p.gpu_capacity = std::llround(in.gpu_gib * static_cast<double>(kGiB));
  p.ram_fits = p.ram.total <= p.ram_capacity;
  p.gpu_fits = p.gpu.total <= p.gpu_capacity;
  p.fits = p.ram_fits && p.gpu_fits;
  p.alltoall_bytes_per_node = AllToAllBytesPerNode(o, p.params, in, p.tokens_per_node);

  // The GPU side is the same at every node count, and so is everything of
  // the node's but its share of the experts, which stops shrinking at one
  // expert per layer (N = num_experts).
  const int64_t gpu_fixed = p.gpu.total - p.gpu.activations;
  const int64_t per_token = p.gpu.activations / (in.micro_batch * in.seq_len);
  p.max_tokens_per_gpu = gpu_fixed >= p.gpu_capacity ? 0 : (p.gpu_capacity - gpu_fixed) / per_token;
  if (!p.gpu_fits) {
    p.why_no_node_count = absl::StrFormat(
        "the dense part (weights%s and activations: %.1f GiB) does not fit one %g GiB GPU at any "
        "node count, since every GPU holds all of it",
        in.mode == PlanMode::kFull ? ", gradients, AdamW states" : ", LoRA", GiB(p.gpu.total),
        in.gpu_gib);
    return p;
  }
  for (int64_t n = 1; n <= std::max<int64_t>(o.num_experts, 1); ++n) {
    if (NodeMemoryAt(o, p.params, in, n, p.rows_per_node).total <= p.ram_capacity) {
      p.min_nodes = n;
      return p;
    }
  }
  p.why_no_node_count = absl::StrFormat(
      "even one expert of each MoE layer per node needs %.1f GiB of RAM (the activations and the "
      "reserve do not shrink with more nodes)",
      GiB(NodeMemoryAt(o, p.params, in, o.num_experts, p.rows_per_node).total));
  return p;
}

absl::StatusOr<bool> RunPlan(const std::string& config_json, const PlanInputs& in, bool json,
                             std::ostream& out) {
  if (config_json.empty()) {
    return absl::InvalidArgumentError("plan: --model CONFIG_JSON is required (an HF config.json)");
  }
  std::error_code ec;
  if (!fs::is_regular_file(config_json, ec)) {
    return absl::NotFoundError(absl::StrCat("plan: --model: no such file '", config_json, "'"));
  }
  MOEFIT_RETURN_IF_ERROR(CheckPlanInputs(in));
  proto::ModelConfig model;
  MOEFIT_RETURN_IF_ERROR(MergeHfConfigJson(config_json, &model));
  absl::StatusOr<framework::ModelOptions> resolved = ResolveModelConfig(model);
  if (!resolved.ok()) {
    // The field is named; say which file it came from.
    return absl::Status(resolved.status().code(), absl::StrCat("plan: --model ", config_json, ": ",
                                                               resolved.status().message()));
  }
  const framework::ModelOptions& options = *resolved;
  const Plan plan = ComputePlan(options, in);
  if (json) {
    out << ToJson(config_json, options, in, plan).dump(2) << "\n";
  } else {
    PrintText(config_json, options, in, plan, out);
  }
  return plan.fits;
}

}  // namespace moefit::launch
