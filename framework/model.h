// The MoE decoder-only transformer shared by every family.
//
// embedding -> N x [RMSNorm -> causal attention -> residual -> RMSNorm -> MoE
// block or dense SwiGLU MLP -> residual] -> RMSNorm -> LM head (tied or not).
// Attention is GQA (RoPE on all or the first part of each head; optional
// per-head q/k RMSNorm; optional q/k/v bias) or DeepSeek's multi-head latent
// attention; rotary frequencies are plain or YaRN-scaled. The MoE block is a
// router (softmax top-k, or sigmoid with correction bias and groups), the
// routed experts, and optionally a shared expert (qwen2_moe's gated one, or
// DeepSeek's ungated ones).
//
// The dense parts live on the dense device (CUDA when available, else CPU);
// routed experts live on the CPU in the packed layout and are computed by an
// expert backend; only activations cross between the two. Parameters are plain
// leaf tensors named as in HF transformers v5, so that checkpoints map onto
// them by name.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "experts/expert_backend.h"
#include "framework/expert_cache.h"
#include "framework/lora.h"
#include "framework/model_options.h"
#include "router/expert_placement.h"

namespace moefit::parallel {
class Communicator;
class Dispatcher;
}  // namespace moefit::parallel

namespace moefit::framework {

struct RotaryTables;

// What is kept for the backward pass (train.recompute).
enum class Recompute {
  kNone,
  kExperts,  // each expert layer keeps its input only; gate/up are recomputed
  kFull,     // each decoder layer keeps its input only and runs again
};

struct ModelRuntime {
  c10::Device dense_device = c10::kCPU;
  // Storage dtype of the routed experts: float32, bfloat16, or (a frozen base:
  // LoRA, or frozen_base) float8_e4m3fn with a float32 scale per 128 x 128 block, kept
  // as a block-scaled FP8 checkpoint stores it (CheckFp8Experts says when a
  // model can), or kByte: int4 as compressed-tensors' pack-quantized
  // checkpoints store it (experts::ExpertWeights), in groups of
  // int4_group_size inputs with int8 zero points where int4_zero_points.
  // FP8 and int4 experts compute in bfloat16 (expert_compute_dtype()).
  at::ScalarType expert_dtype = at::kFloat;
  int64_t int4_group_size = 32;
  bool int4_zero_points = false;
  // Trained experts narrower than float32 keep float32 master weights: the
  // parameters are the masters (gradients and AdamW in float32), and a copy in
  // expert_dtype, refreshed by SyncExpertCopies, is what the experts compute
  // with. Without it narrow experts are trained in their own dtype, where
  // small updates round away.
  bool expert_master_weights = false;
  // Storage dtype of the dense matrices (projections, embedding, LM head):
  // float32 unless the base is frozen (LoRA), when it may stay bfloat16 (the
  // activations stay float32; see framework/lora.h). Norms, biases and
  // routers are float32 always.
  at::ScalarType dense_dtype = at::kFloat;
  // LoRA fine-tuning when lora.enabled(): every base weight is frozen and only
  // the adapters are trained.
  LoraOptions lora;
  // No base weight is trained (moefit eval): they require no gradient, and
  // the experts may be FP8, as under LoRA.
  bool frozen_base = false;
  Recompute recompute = Recompute::kNone;
  std::string expert_backend = "grouped";
  int expert_threads = 0;  // 0 = the process's intra-op thread count
  experts::ThreadPool expert_thread_pool = experts::ThreadPool::kOpenMp;
  // Bytes of expert weights the backend keeps packed between GEMMs.
  int64_t expert_packed_bytes = experts::BackendOptions{}.packed_weight_bytes;
  // Expert parallelism: the group of ranks that share one copy of the experts
  // (nullptr = this process alone) and how tokens reach them ("alltoall" or
  // "allgather", parallel/dispatcher.h).
  std::shared_ptr<parallel::Communicator> expert_group;
  std::string dispatcher = "alltoall";
  // Token chunks each MoE layer's dispatch, expert compute and combine are
  // pipelined over (Dispatcher::Run); 1 = no pipelining.
  int64_t dispatch_chunks = 1;
  // The routers also report the entropy of their choices
  // (MoeLayerRouting::entropy_sum), for routing telemetry.
  bool routing_telemetry = false;
  // The hot-expert cache's device (framework/expert_cache.h): the process's
  // GPU, or the CPU as a second compute path (the twin the cache is tested
  // on). Unset: no cache; the routed experts are all computed by the host
  // backend.
  std::optional<c10::Device> expert_cache_device;

  // The dtype the experts' inputs and outputs travel and compute in.
  at::ScalarType expert_compute_dtype() const {
    return expert_dtype == at::kFloat8_e4m3fn || expert_dtype == at::kByte ? at::kBFloat16
                                                                           : expert_dtype;
  }
  // Whether the routed experts are quantized as stored (FP8 or int4): frozen.
  bool quantized_experts() const {
    return expert_dtype == at::kFloat8_e4m3fn || expert_dtype == at::kByte;
  }
};

// Whether `options`' routed experts can be kept in float8_e4m3fn with block
// scales: the kernels' 128 x 128 blocks (the checkpoint's weight_block_size,
// when it has one), and gate and up halves that each fill whole blocks
// (moe_intermediate_size a multiple of 128), so that their scales join into
// one grid. InvalidArgument naming the field otherwise.
absl::Status CheckFp8Experts(const ModelOptions& options);

struct Parameter {
  std::string name;          // e.g. model.layers.0.mlp.experts.gate_up_proj
  at::Tensor tensor;         // a leaf; requires_grad unless frozen (the base under LoRA)
  bool weight_decay = true;  // false for norms and biases
  bool expert = false;       // routed-expert weight (CPU resident; this rank's experts only)
};

// FP8 experts' block scales beside their weights: "<weight>_scale_inv".
std::string ScaleInvName(const std::string& weight_name);
// int4 experts' group scales and zero points beside their weights:
// "<weight>_scale", "<weight>_zero_point".
std::string Int4ScaleName(const std::string& weight_name);
std::string Int4ZeroPointName(const std::string& weight_name);

// What one MoE layer's router saw in a forward pass.
struct MoeLayerRouting {
  int64_t layer_idx = 0;
  at::Tensor prob_sum;      // [E] fp32, differentiable (for the Switch balance loss)
  at::Tensor expert_count;  // [E] fp32 assignments per expert (this rank's tokens), CPU
  // Sigmoid routers: DeepSeek's sequence-wise balance loss summed over this
  // rank's sequences (differentiable; router::SequenceBalanceLossSum in router/balance.h).
  at::Tensor seq_balance_sum;
  // The layer's e_score_correction_bias buffer itself (undefined without one):
  // the trainer moves it in place after each step.
  at::Tensor correction_bias;
  // With ModelRuntime::routing_telemetry: the sum over this rank's tokens of
  // the entropy of their routing distributions (router::RouterEntropySum), a
  // float64 scalar on the CPU; undefined otherwise.
  at::Tensor entropy_sum;
  // [tokens, k] int64 on the CPU: each of this rank's tokens' chosen experts
  // (global ids), in the order of the layer's input rows.
  at::Tensor topk_idx;
};

struct ForwardResult {
  at::Tensor logits;  // [B, T, vocab] fp32 on the dense device
  std::vector<MoeLayerRouting> moe_layers;
};

// How MoeModel::Create fills the weights.
enum class WeightInit {
  // The seeded random draw described at MoeModel::Create.
  kRandom,
  // Allocated and left unwritten (at::empty: no page is committed until it is
  // written), for a model whose every tensor is loaded next (LoadPretrained
  // fills them in place): no random draw, and the weights are in memory once.
  kUninitialized,
};

class MoeModel {
 public:
  // Builds the model; each rank allocates only its own experts (contiguous
  // placement). With kRandom the weights are drawn from N(0,
  // initializer_range) (norms 1, biases 0) from a generator seeded with
  // `seed`, independent of the device and of the expert-parallel degree: every
  // rank draws the same full sequence of values and keeps its own experts'
  // (RandnRows), so N ranks start from exactly the weights of one.
  static absl::StatusOr<std::unique_ptr<MoeModel>> Create(const ModelOptions& options,
                                                          const ModelRuntime& runtime,
                                                          uint64_t seed,
                                                          WeightInit init = WeightInit::kRandom);
  ~MoeModel();

  // input_ids: [B, T] int64 (any device). Packed sequences (framework/data.h)
  // also give position_ids [B, T] (restarting at 0 in every sample; undefined
  // = 0..T-1 in every row) and segment_ids [B, T] (which sample each token
  // belongs to; undefined = one per row): rotary angles then follow the
  // position ids, and a token attends only to earlier tokens of its own
  // segment. Rows of one segment with positions 0..T-1 take the plain causal
  // path, bit for bit the numbers without them.
  ForwardResult Forward(const at::Tensor& input_ids, const at::Tensor& position_ids = {},
                        const at::Tensor& segment_ids = {});

  // The model's weights, named as in HF transformers (frozen under LoRA).
  const std::vector<Parameter>& parameters() const { return params_; }
  // LoRA adapters (float32): dense modules' "<module>.lora_A.weight" [r, in]
  // and ".lora_B.weight" [out, r]; the routed experts'
  // "model.layers.L.mlp.experts.gate_up_proj.lora_A" [E_local, r, H], ".lora_B"
  // [E_local, 2I, r], and down_proj's [E_local, r, I] and [E_local, H, r]
  // (expert true, this rank's experts). Empty without LoRA.
  const std::vector<Parameter>& adapters() const { return adapters_; }
  // What the optimizer trains: the adapters under LoRA, else parameters().
  const std::vector<Parameter>& trainable_parameters() const {
    return adapters_.empty() ? params_ : adapters_;
  }
  // Folds every adapter into its base weight (W += scaling·B·A, computed in
  // float32 and rounded once to W's dtype) and zeroes the adapters' B, so the
  // model computes the same function with the adapters folded in.
  // FailedPrecondition with FP8 experts (nothing to fold into).
  absl::Status MergeAdapters();
  // Rewrites the experts' compute copies from their float32 masters (with
  // expert_master_weights; a no-op otherwise): after creation and loading;
  // during training the optimizer writes them (expert_master_copies).
  void SyncExpertCopies();
  // The compute copies (empty without expert_master_weights), for memory counts.
  std::vector<at::Tensor> expert_copies() const;

  // Each float32 master with its compute copy, the master's name, and the
  // offset of this rank's first element in the whole [num_experts, ...]
  // tensor (empty without expert_master_weights): what the optimizer
  // attaches to write the copies in its own pass.
  struct MasterCopy {
    std::string name;
    at::Tensor master, copy;
    int64_t first_element = 0;
  };
  std::vector<MasterCopy> expert_master_copies() const;
  // Training mode turns on the adapters' dropout (off by default: inference).
  void SetTraining(bool training);
  // ModelRuntime::routing_telemetry: the routers report their entropy too.
  void SetRoutingTelemetry(bool on) { runtime_.routing_telemetry = on; }
  // The hot-expert cache (ModelRuntime::expert_cache_device): decoder layer
  // `layer_idx` (a MoE layer) computes its local experts `local_experts`
  // (ascending) on the cache's device from the next forward pass on.
  void SetCachedExperts(int64_t layer_idx, std::vector<int64_t> local_experts);
  // Its cached local experts (empty without a cache).
  const std::vector<int64_t>& cached_experts(int64_t layer_idx) const;
  // Rows (token, expert) this process's experts computed since the last
  // call, and how many of them on the cache's device; starts counting anew.
  struct ExpertRows {
    int64_t total = 0;
    int64_t cached = 0;
  };
  ExpertRows TakeExpertRows();
  // The resolved LoRA targets (empty without LoRA).
  const LoraTargets& lora_targets() const { return lora_targets_; }
  // State that is saved and loaded with the weights but not trained by the
  // optimizer (the routers' e_score_correction_bias), requires_grad false.
  const std::vector<Parameter>& buffers() const { return buffers_; }
  // parameters() then buffers(): everything a checkpoint holds.
  std::vector<Parameter> named_tensors() const;
  const ModelOptions& options() const { return options_; }
  const ModelRuntime& runtime() const { return runtime_; }
  const router::ExpertPlacement& placement() const { return placement_; }
  // Bytes of expert weights the backend keeps packed now
  // (ModelRuntime::expert_packed_bytes at most).
  int64_t expert_pack_bytes() const;

 private:
  struct Layer;
  MoeModel(const ModelOptions& options, const ModelRuntime& runtime,
           router::ExpertPlacement placement);
  void Build(uint64_t seed, WeightInit init);
  // Creates the adapters of lora_targets_ (A drawn as PEFT draws it, B zero).
  void AddAdapters(uint64_t seed);
  // Every dense linear module by HF name: its weight and its adapter slot.
  struct LinearSlot {
    std::string name;
    at::Tensor* weight;
    LoraAdapter* adapter;
  };
  std::vector<LinearSlot> LinearSlots();
  at::Tensor DecoderLayer(const Layer& layer, const at::Tensor& hidden, const RotaryTables& rope,
                          const at::Tensor& segments, MoeLayerRouting* routing);
  // x: [num_sequences * T, H] (sequence-major).
  at::Tensor Moe(const Layer& layer, const at::Tensor& x, int64_t num_sequences,
                 MoeLayerRouting* routing);

  ModelOptions options_;
  ModelRuntime runtime_;
  std::unique_ptr<experts::ExpertBackend> backend_;
  // The hot-expert cache: its backend (eager: ATen ops, on any device), each
  // decoder layer's cached experts, and the rows computed.
  std::unique_ptr<experts::ExpertBackend> cache_backend_;
  std::vector<LayerExpertCache> expert_caches_;
  ExpertRows expert_rows_;
  router::ExpertPlacement placement_;
  std::unique_ptr<parallel::Dispatcher> dispatcher_;
  std::vector<Parameter> params_;
  std::vector<Parameter> buffers_;
  std::vector<Parameter> adapters_;
  LoraTargets lora_targets_;

  std::vector<Layer> layers_;
  at::Tensor embed_tokens_, final_norm_, lm_head_;
  LoraAdapter lm_head_lora_;
};

// Rows [first, first + num) along dim 0 of at::randn(shape, gen) * scale, in
// `dtype`, leaving `gen` where that full draw leaves it; how the routed experts
// of a rank are drawn. LibTorch's CPU normal sampler fills a contiguous float
// tensor of at least 16 elements in independent blocks of 16 (uniforms in
// order, then Box-Muller per block; only a ragged tail is redrawn), so when a
// row's element count is a multiple of 16 drawing the rows one after another
// gives the values of the full draw, and only this rank's rows plus one row of
// scratch are ever allocated. Otherwise the full tensor is drawn and narrowed.
at::Tensor RandnRows(at::IntArrayRef shape, int64_t first, int64_t num, double scale,
                     at::ScalarType dtype, at::Generator& gen);

// Sum over positions of next-token cross entropy (logits[:, t] predicts
// labels[:, t + 1]; label -100 is not trained on) and the number of positions
// counted. Dividing by a global token count gives the mean over a global batch.
struct LossSum {
  at::Tensor sum;  // scalar fp32, differentiable
  int64_t num_tokens = 0;
};
LossSum CausalLmLossSum(const at::Tensor& logits, const at::Tensor& labels);

// Number of positions CausalLmLossSum would count for `labels`.
int64_t CountTrainedTokens(const at::Tensor& labels);

}  // namespace moefit::framework
