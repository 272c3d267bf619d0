// The expert-backend interface: how one layer's routed experts are computed.
//
// A backend sees rows in segments, each segment the consecutive rows of one
// local expert: segment s holds counts[s] rows of expert s % E (E = the
// weights' expert count; counts.size() is a multiple of E). With E segments
// this is rows grouped by expert; with W*E it is what an all-to-all delivers
// (per source rank, grouped by expert), so no regrouping copy is needed. The
// packed weights are transformers v5's layout: gate_up_proj [E, 2I, H] (gate
// rows first, then up) and down_proj [E, H, I]. It computes, for each row a of
// expert e,
//     y[a] = down_e · (silu(gate_e · x[a]) ⊙ (up_e · x[a]))
// and, on request, the gradients. Routing weights are NOT applied here: they
// are applied on the token's home rank after combine, so that the router gets
// its gradient locally. Backends know nothing of ranks, files or routing.
//
// Optional LoRA adapters on the experts (ExpertLora) add a low-rank term to
// the gate/up and down projections; the base weights may then be frozen
// (BackwardOptions::base_weight_grads = false).
//
// Every backend has its own forward and backward; `eager` (a plain per-expert
// loop) is the reference the others are tested against.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moefit::experts {

// LoRA adapters of one layer's local experts. With s = scaling, expert e's
// projections become
//     gate_up = x·gate_up_projᵀ + s·(x·gate_up_aᵀ)·gate_up_bᵀ
//     y       = h·down_projᵀ    + s·(h·down_aᵀ)·down_bᵀ
// computed as two thin GEMMs per projection, never materialising W + B·A. One
// adapter covers the fused gate|up rows (as PEFT's target_parameters does on
// transformers' fused experts.gate_up_proj). Either pair may be undefined: that
// projection has no adapter. Each pair has its own rank r. The adapters are
// float32 (float64 allowed with a float64 base), whatever the base dtype: the
// low-rank branch runs in the adapters' dtype (inputs upcast) and is added to
// the base output, so a bfloat16 base gets a float32 LoRA branch.
struct ExpertLora {
  at::Tensor gate_up_a;  // [E, r, H]
  at::Tensor gate_up_b;  // [E, 2I, r]
  at::Tensor down_a;     // [E, r, I]
  at::Tensor down_b;     // [E, H, r]
  double scaling = 1.0;  // PEFT's lora_alpha / r

  bool has_gate_up() const { return gate_up_a.defined() && gate_up_b.defined(); }
  bool has_down() const { return down_a.defined() && down_b.defined(); }
  bool any() const { return has_gate_up() || has_down(); }
};

// Packed weights of one layer's local experts: float32, bfloat16, or, frozen
// only, quantized as a checkpoint stores them and multiplied as they are,
// block by block, never dequantized whole:
//   float8_e4m3fn with float32 scales per 128 x 128 block of each expert's
//     matrix (DeepSeek-V3, Kimi-K2);
//   int4 (compressed-tensors' pack-quantized, Kimi-K2-Thinking): uint8
//     tensors holding two 4-bit elements per byte, the low nibble first, each
//     q + 8 for q in [-8, 7], every row's bytes padded to whole 32-bit words
//     as the checkpoint's int32 words are -- gate_up_proj [E, 2I, W(H)],
//     down_proj [E, H, W(I)] with W(n) = ceil(n / 8) * 4 -- with a bfloat16
//     scale and, asymmetric, an int8 zero point z per group of
//     int4_group_size consecutive inputs of a row; an element is worth
//     bfloat16((q - z) x scale), what the checkpoint's own decompression gives.
struct ExpertWeights {
  at::Tensor gate_up_proj;  // [E, 2I, H]
  at::Tensor down_proj;     // [E, H, I]
  ExpertLora lora;          // none by default
  // FP8: [E, ceil(2I/128), ceil(H/128)] float32; int4: [E, 2I, ceil(H/G)] bfloat16.
  at::Tensor gate_up_scale;
  // FP8: [E, ceil(H/128), ceil(I/128)] float32; int4: [E, H, ceil(I/G)] bfloat16.
  at::Tensor down_scale;
  // int4 with zero points only: int8, shaped as the scales.
  at::Tensor gate_up_zero_point, down_zero_point;
  int64_t int4_group_size = 0;  // G, int4 only

  bool int4() const { return gate_up_proj.scalar_type() == at::kByte; }
  int64_t hidden() const { return down_proj.size(1); }
  int64_t intermediate() const { return gate_up_proj.size(1) / 2; }
};

// The bytes of one row of n int4 elements: whole 32-bit words, as
// compressed-tensors packs them.
inline int64_t Int4RowBytes(int64_t n) { return (n + 7) / 8 * 4; }

struct ExpertGrads {
  at::Tensor x;  // [A, H]
  // [E, 2I, H] and [E, H, I]; undefined without base_weight_grads. A backend
  // may return them in float32 for a bfloat16 base (the gradients of float32
  // masters, summed in float32).
  at::Tensor gate_up_proj;
  at::Tensor down_proj;
  // LoRA gradients, in the adapters' dtype, defined where the adapter is;
  // zero for experts with no rows.
  at::Tensor gate_up_a;  // [E, r, H]
  at::Tensor gate_up_b;  // [E, 2I, r]
  at::Tensor down_a;     // [E, r, I]
  at::Tensor down_b;     // [E, H, r]
};

struct BackwardOptions {
  // Gradients of the base weights gate_up_proj and down_proj. false (a frozen
  // base, LoRA fine-tuning): no weight-gradient GEMM runs for them at all, only
  // dX and the LoRA gradients, and grads.gate_up_proj/down_proj are undefined.
  bool base_weight_grads = true;
};

// Where the grouped backend runs its tiles in parallel.
enum class ThreadPool : uint8_t {
  kOpenMp,  // LibTorch's OpenMP threads: the one pool of the process
  kOneTbb,  // a oneTBB arena of the backend's own
};

struct BackendOptions {
  // CPU threads for expert compute; 0 = the process's intra-op thread count.
  int num_threads = 0;
  ThreadPool thread_pool = ThreadPool::kOpenMp;
  // Bytes of expert weights kept packed in the GEMM kernels' format between
  // calls (see packed_weights.h): each weight is packed once per change
  // instead of on every GEMM. Up to two packs per weight (forward and dX
  // orientations), each the weight's size in float32 (half that for
  // bfloat16 weights where the kernels multiply bfloat16 pairs:
  // kernels::MultipliesBf16Pairs; there an FP8 weight's pack takes a byte
  // per value, kernels::PackedB); weights beyond the budget are
  // packed per call. 0: never kept.
  int64_t packed_weight_bytes = int64_t{2} << 30;
  // SwiGLU fused into the gate/up GEMM: its columns computed in blocks, gate
  // and up of a block back to back, and silu(gate)·up of the block computed
  // right after with a vector exp (kernels/swiglu.h); the backward's
  // derivative with the vector exp too. false: one GEMM writes the whole
  // [rows, 2I] block, then the portable kernels' scalar pass (std::exp)
  // computes h, and the derivative -- the slow twin the fused path is tested
  // against. Only backends with their own kernels (grouped) read it.
  bool fused_swiglu = true;
};

class ExpertBackend {
 public:
  virtual ~ExpertBackend() = default;

  // Registry name ("eager", "grouped", ...).
  virtual std::string_view name() const = 0;

  // x: [A, H] with A = sum(counts) in segments (see above), same dtype and
  // device as the base weights (float32, bfloat16 or float64; CPU; float32 or
  // bfloat16 with FP8 or int4 weights, which are frozen). Or, with x_index defined
  // ([A] int64, values in [0, R)), x is [R, H] and row a of the computation
  // is x[x_index[a]]: a token's row, received once, is read once per local
  // expert it visits without being copied out per expert. Returns
  // y [A, H]. `*activations` receives what Backward needs: the [A, 2I] gate/up
  // pre-activations, LoRA term included. With activations == nullptr nothing is
  // kept, and Backward recomputes them from x (expert recomputation: only the
  // layer's input stays alive between forward and backward). bfloat16 inputs
  // are multiplied with fp32 accumulation.
  virtual at::Tensor Forward(const at::Tensor& x, const at::Tensor& x_index,
                             const std::vector<int64_t>& counts, const ExpertWeights& weights,
                             at::Tensor* activations) = 0;
  // x holds the A rows themselves.
  at::Tensor Forward(const at::Tensor& x, const std::vector<int64_t>& counts,
                     const ExpertWeights& weights, at::Tensor* activations) {
    return Forward(x, at::Tensor(), counts, weights, activations);
  }

  // Gradients of sum(grad_y ⊙ y) with respect to x, the base weights (unless
  // options.base_weight_grads is false) and every defined LoRA tensor, given
  // the inputs of Forward and the activations it saved, or an undefined
  // tensor if it saved none. The low-rank intermediates (x·Aᵀ, h·Aᵀ) are
  // recomputed here rather than saved. Experts with no rows get zero weight
  // gradients. grads.x is [A, H], one row per row of the computation (with
  // x_index, the caller sums the rows that read the same row of x).
  virtual ExpertGrads Backward(const at::Tensor& grad_y, const at::Tensor& x,
                               const at::Tensor& x_index, const std::vector<int64_t>& counts,
                               const ExpertWeights& weights, const at::Tensor& activations,
                               const BackwardOptions& options) = 0;
  ExpertGrads Backward(const at::Tensor& grad_y, const at::Tensor& x,
                       const std::vector<int64_t>& counts, const ExpertWeights& weights,
                       const at::Tensor& activations, const BackwardOptions& options = {}) {
    return Backward(grad_y, x, at::Tensor(), counts, weights, activations, options);
  }

  // Bytes of packed weights kept between calls now, within
  // BackendOptions::packed_weight_bytes (0 for backends that keep none).
  virtual int64_t kept_pack_bytes() const { return 0; }
};

}  // namespace moefit::experts
