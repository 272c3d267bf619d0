// The tiled, parallel CPU expert backend; see grouped_backend.h.
#include "experts/grouped_backend.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <memory>

#include "experts/kernels/gemm.h"
#include "experts/kernels/swiglu.h"
#include "experts/packed_weights.h"

namespace moefit::experts {
namespace {

// A block of consecutive rows of one expert.
struct Tile {
  int64_t expert = 0;
  int64_t begin = 0;
  int64_t size = 0;
};

// Tiles handed out largest first (by cost(tile), ties in their order), so
// that the last ones to start, while other threads have run out of work, are
// the shortest. Which thread computes a tile, and when, changes no bits:
// each tile writes its own rows or block.
template <typename T, typename Cost>
void LargestFirst(std::vector<T>& tiles, const Cost& cost) {
  std::stable_sort(tiles.begin(), tiles.end(),
                   [&](const T& a, const T& b) { return cost(a) > cost(b); });
}

// Cuts each segment (segment s: counts[s] rows of expert s % num_experts)
// into blocks of at most `block` rows, largest first.
std::vector<Tile> RowTiles(const std::vector<int64_t>& counts, int64_t num_experts, int64_t block) {
  std::vector<Tile> tiles;
  int64_t row = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    const int64_t e = static_cast<int64_t>(s) % num_experts;
    for (int64_t r = 0; r < counts[s]; r += block) {
      tiles.push_back({e, row + r, std::min(block, counts[s] - r)});
    }
    row += counts[s];
  }
  LargestFirst(tiles, [](const Tile& t) { return t.size; });
  return tiles;
}

// Rows per tile: small enough that every thread gets several tiles, large
// enough that each GEMM runs near peak.
int64_t TileRows(int64_t num_rows, int num_threads) {
  const int64_t want = (num_rows + 4 * num_threads - 1) / (4 * num_threads);
  return std::clamp<int64_t>(want, 16, 1024);
}

// out = a · b written in place into `out` (a view into a larger buffer).
void MmInto(at::Tensor out, const at::Tensor& a, const at::Tensor& b) { at::mm_out(out, a, b); }

// The base GEMMs run on moefit's kernels (experts/kernels) for float32,
// bfloat16, FP8 and int4 weights; float64 (the gradient checks) takes
// LibTorch's mm.
bool OnKernels(const at::Tensor& x) { return x.scalar_type() != at::kDouble; }

kernels::ElemType KernelType(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kernels::ElemType::kF32;
    case at::kBFloat16:
      return kernels::ElemType::kBF16;
    case at::kFloat8_e4m3fn:
      return kernels::ElemType::kF8E4M3;
    default:
      TORCH_CHECK(false, "the grouped expert kernels take float32, bfloat16 or float8_e4m3fn; got ",
                  t);
  }
}

// A 2-D tensor (rows may be strided: a narrowed view) as A or B, as it is or
// transposed.
kernels::Operand MatrixOp(const at::Tensor& t, bool transposed = false) {
  kernels::Operand op;
  op.data = t.data_ptr();
  op.type = KernelType(t.scalar_type());
  op.row_stride = transposed ? t.stride(1) : t.stride(0);
  op.col_stride = transposed ? t.stride(0) : t.stride(1);
  return op;
}

// Rows of a matrix as an operand: as they lie in a tensor, or picked from its
// rows by index (Operand::row_index): the computation's input rows read from
// the rows a dispatcher received, each as often as experts visit it.
class InRows {
 public:
  InRows() = default;
  InRows(const at::Tensor& t) : data_(t), rows_(t.size(0)) {}  // NOLINT: rows as they lie
  InRows(const at::Tensor& stored, const int64_t* index, int64_t rows)
      : data_(stored), index_(index), rows_(rows) {}

  int64_t rows() const { return rows_; }
  int64_t cols() const { return data_.size(1); }
  const at::Tensor& stored() const { return data_; }
  InRows Narrow(int64_t begin, int64_t n) const {
    return index_ != nullptr ? InRows(data_, index_ + begin, n) : InRows(data_.narrow(0, begin, n));
  }
  InRows Columns(int64_t c0, int64_t n) const {
    return index_ != nullptr ? InRows(data_.narrow(1, c0, n), index_, rows_)
                             : InRows(data_.narrow(1, c0, n));
  }
  kernels::Operand Op() const {
    kernels::Operand op = MatrixOp(data_);
    op.row_index = index_;
    return op;
  }
  // The rows as a tensor, for LibTorch's ops (the float64 path, whose input
  // is never read by index: MakeInput copies it out).
  const at::Tensor& Tensor() const {
    TORCH_INTERNAL_ASSERT(index_ == nullptr, "rows read by index reached a LibTorch op");
    return data_;
  }

 private:
  at::Tensor data_;
  const int64_t* index_ = nullptr;
  int64_t rows_ = 0;
};

// The computation's input: x's rows, or those picked by x_index (copied out
// for float64, which runs on LibTorch's mm).
struct Input {
  at::Tensor index, stored;  // kept alive while `rows` points into them
  InRows rows;
};

Input MakeInput(const at::Tensor& x, const at::Tensor& x_index) {
  if (!x_index.defined()) return {{}, x, InRows(x)};
  TORCH_CHECK(x_index.dim() == 1 && x_index.scalar_type() == at::kLong && x_index.is_cpu(),
              "expert rows by index: x_index must be [A] int64 on the host");
  TORCH_CHECK(x_index.numel() == 0 ||
                  (x_index.min().item<int64_t>() >= 0 && x_index.max().item<int64_t>() < x.size(0)),
              "expert rows by index: x_index points outside x's ", x.size(0), " rows");
  if (x.scalar_type() == at::kDouble) {
    at::Tensor copied = x.index_select(0, x_index);
    return {{}, copied, InRows(copied)};
  }
  at::Tensor index = x_index.contiguous();
  return {index, x, InRows(x, index.data_ptr<int64_t>(), index.numel())};
}

kernels::Output OutputOp(const at::Tensor& t) {
  TORCH_CHECK(t.stride(1) == 1, "kernel output rows must be contiguous");
  return kernels::Output{t.data_ptr(), KernelType(t.scalar_type()), t.stride(0)};
}

// One packed weight of the layer (gate_up_proj or down_proj, or rows of it)
// with its quantization where it is FP8 or int4.
struct Matrix {
  at::Tensor w;
  WeightQuantization q;

  // Rows [r0, r0 + n) of each expert's matrix (FP8: r0 on a scale block).
  Matrix Rows(int64_t r0, int64_t n) const {
    Matrix m{w.narrow(1, r0, n), q};
    if (w.scalar_type() == at::kFloat8_e4m3fn) {
      TORCH_CHECK(r0 % kernels::kScaleBlock == 0, "FP8 weight rows from ", r0,
                  " do not start on a scale block");
      m.q.scale = q.scale.narrow(1, r0 / kernels::kScaleBlock,
                                 (n + kernels::kScaleBlock - 1) / kernels::kScaleBlock);
    } else if (w.scalar_type() == at::kByte) {
      m.q.scale = q.scale.narrow(1, r0, n);
      if (q.zero_point.defined()) m.q.zero_point = q.zero_point.narrow(1, r0, n);
    }
    return m;
  }
};

Matrix GateUpOf(const ExpertWeights& w) {
  return {w.gate_up_proj,
          {w.gate_up_scale, w.gate_up_zero_point, w.int4_group_size, w.int4() ? w.hidden() : 0}};
}

Matrix DownOf(const ExpertWeights& w) {
  return {w.down_proj,
          {w.down_scale, w.down_zero_point, w.int4_group_size, w.int4() ? w.intermediate() : 0}};
}

// Per expert, the GEMM path of its tiles: streamed when the expert has few
// rows in all, blocked otherwise -- decided by the expert's total, not by a
// tile's, so that a token's result does not depend on how the rows reached
// this rank (one segment or one per source rank) or were cut into tiles.
std::vector<kernels::RowPath> ExpertPaths(const std::vector<int64_t>& counts, int64_t num_experts) {
  std::vector<int64_t> rows(num_experts, 0);
  for (size_t s = 0; s < counts.size(); ++s) rows[s % num_experts] += counts[s];
  std::vector<kernels::RowPath> paths(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) {
    paths[e] = rows[e] <= kernels::kMaxStreamedRows ? kernels::RowPath::kStreamed
                                                    : kernels::RowPath::kBlocked;
  }
  return paths;
}

using Packs = PackedWeightCache::Packs;

// out = a · w[e]ᵀ (transposed) or a · w[e], with w's packs made ahead for
// this orientation where there are (the blocked path; the streamed one reads
// w as it is).
void WeightMm(at::Tensor out, const InRows& a, const Matrix& m, int64_t e, bool transposed,
              kernels::RowPath path, const Packs* packs) {
  if (!OnKernels(a.stored())) {
    MmInto(out, a.Tensor(), transposed ? m.w[e].t() : m.w[e]);
    return;
  }
  if (packs != nullptr && path == kernels::RowPath::kBlocked) {
    kernels::Gemm(kernels::ActiveIsa(), a.rows(), a.Op(), packs->Get(e), OutputOp(out),
                  /*accumulate=*/false, path);
    return;
  }
  kernels::Gemm(a.rows(), out.size(1), a.cols(), a.Op(),
                ExpertWeightOperand(m.w, m.q, e, transposed), OutputOp(out), /*accumulate=*/false,
                path);
}

// Torch's own intra-op threads are set to one while the tiles run: the
// parallelism is ours, and nested MKL/oneDNN/OpenMP teams would oversubscribe.
// at::set_num_threads sets the OpenMP and MKL thread counts of the calling
// thread only: the caller uses this guard, an OpenMP team's threads inherit
// its count (and ATen runs nested loops serially), and each oneTBB worker
// makes itself single-threaded once (MakeWorkerSingleThreaded).
class SingleThreadedTorch {
 public:
  SingleThreadedTorch() : saved_(at::get_num_threads()) {
    if (saved_ != 1) at::set_num_threads(1);
  }
  ~SingleThreadedTorch() {
    if (saved_ != 1) at::set_num_threads(saved_);
  }

 private:
  int saved_;
};

void MakeWorkerSingleThreaded() {
  thread_local bool done = false;
  if (!done) {
    at::set_num_threads(1);
    done = true;
  }
}

// SwiGLU of one tile in float64 (the gradient checks, off the kernels), with
// ATen's ops: h = silu(gate)·up and, given dh, d_gate_up = [d_gate | d_up].
void SiluMulDouble(const at::Tensor& gate_up, const at::Tensor& h) {
  const int64_t inter = h.size(1);
  h.copy_(at::silu(gate_up.narrow(1, 0, inter)) * gate_up.narrow(1, inter, inter));
}

void SiluMulBackwardDouble(const at::Tensor& gate_up, const at::Tensor& dh, const at::Tensor& h,
                           const at::Tensor& d_gate_up) {
  const int64_t inter = h.size(1);
  const at::Tensor g = gate_up.narrow(1, 0, inter), u = gate_up.narrow(1, inter, inter);
  const at::Tensor s = at::sigmoid(g), act = g * s;
  h.copy_(act * u);
  d_gate_up.narrow(1, 0, inter).copy_(dh * u * s * (1 + g * (1 - s)));
  d_gate_up.narrow(1, inter, inter).copy_(dh * act);
}

// The LoRA products run on the float32 kernels (the active set, held to at
// most avx512): the adapters are float32 and are not rounded to bfloat16 as
// the bfloat16 kernels would round them; bfloat16 activations are converted
// exactly as they are packed, so no upcast copy is made.
kernels::Isa Float32Isa() { return std::min(kernels::ActiveIsa(), kernels::Isa::kAvx512); }

// Whether a LoRA product of these operands runs on the float32 kernels
// (float64, the gradient checks, takes LibTorch's mm).
bool LoraOnKernels(const at::Tensor& in, const at::Tensor& m) {
  return OnKernels(in) && m.scalar_type() == at::kFloat;
}

// s·(in·m) in m's dtype (the adapters'), `in` read as that dtype: the [n, r]
// low-rank intermediates of a LoRA branch and their gradients. Always a fresh
// tensor, so that a recomputed value is bitwise the value first computed;
// `path` is the expert's (ExpertPaths), so a row's value does not depend on
// its tile.
at::Tensor ScaledMm(const InRows& in, const at::Tensor& m, double s, kernels::RowPath path) {
  if (!LoraOnKernels(in.stored(), m)) return at::mm(in.Tensor().to(m.scalar_type()), m).mul_(s);
  at::Tensor out = at::empty({in.rows(), m.size(1)}, m.options());
  kernels::Gemm(Float32Isa(), in.rows(), m.size(1), in.cols(), in.Op(), MatrixOp(m), OutputOp(out),
                /*accumulate=*/false, path);
  return out.mul_(s);
}

// out += u·m with u and m in the adapters' dtype, summed in float32 and
// rounded once to out's dtype.
void AddMm(at::Tensor out, const at::Tensor& u, const at::Tensor& m, kernels::RowPath path) {
  if (LoraOnKernels(u, m) && out.scalar_type() != at::kDouble) {
    kernels::Gemm(Float32Isa(), u.size(0), m.size(1), u.size(1), MatrixOp(u), MatrixOp(m),
                  OutputOp(out), /*accumulate=*/true, path);
  } else if (out.scalar_type() == m.scalar_type()) {
    out.addmm_(u, m);
  } else {
    out.add_(at::mm(u, m));
  }
}

// The gate/up pre-activations of one tile of expert e, LoRA term included,
// written to gu_t. Returns the LoRA intermediate s·(x_t·Aᵀ) (undefined
// without a gate_up adapter).
at::Tensor GateUpTile(const InRows& x_t, int64_t e, const ExpertWeights& w, at::Tensor gu_t,
                      kernels::RowPath path, const Packs* packs) {
  WeightMm(gu_t, x_t, GateUpOf(w), e, /*transposed=*/true, path, packs);
  if (!w.lora.has_gate_up()) return {};
  at::Tensor u = ScaledMm(x_t, w.lora.gate_up_a[e].t(), w.lora.scaling, path);
  AddMm(gu_t, u, w.lora.gate_up_b[e].t(), path);
  return u;
}

// Columns per block of the fused gate/up GEMM (a multiple of every
// microkernel's nr and of the FP8 scale block): a block's gate and up
// outputs stay in L2 until SiLU·up reads them.
constexpr int64_t kSwiGluColumns = 256;

// Columns col0.. of a tensor's rows as kernel rows.
kernels::Rows RowsOf(const at::Tensor& t, int64_t col0 = 0) {
  TORCH_CHECK(t.stride(1) == 1, "kernel rows must be contiguous");
  const int64_t bytes = t.element_size();
  return {static_cast<char*>(t.data_ptr()) + col0 * bytes, KernelType(t.scalar_type()),
          t.stride(0)};
}

// The gate half (rows [0, I) of each expert's [2I, H]) or the up half of
// gate_up_proj, with its quantization; FP8 halves need I % 128 == 0.
Matrix Half(const ExpertWeights& w, bool up) {
  const int64_t inter = w.intermediate();
  return GateUpOf(w).Rows(up ? inter : 0, inter);
}

// Whether the fused gate/up path can run: the base GEMM alone makes the
// pre-activations (no LoRA term to add first), on the kernels, and FP8
// halves start on a scale block.
bool CanFuseGateUp(const at::Tensor& x, const ExpertWeights& w) {
  return OnKernels(x) && !w.lora.has_gate_up() &&
         (w.gate_up_proj.scalar_type() != at::kFloat8_e4m3fn ||
          w.intermediate() % kernels::kScaleBlock == 0);
}

// out = x_t · half[e][c0 : c0 + n]ᵀ, from the half's packs where there are.
void HalfMm(at::Tensor out, const InRows& x_t, const Matrix& half, int64_t e, int64_t c0, int64_t n,
            kernels::RowPath path, const Packs* packs) {
  if (packs != nullptr && path == kernels::RowPath::kBlocked) {
    kernels::GemmColumns(kernels::ActiveIsa(), x_t.rows(), x_t.Op(), packs->Get(e), c0, n,
                         OutputOp(out), /*accumulate=*/false, path);
    return;
  }
  const Matrix rows = half.Rows(c0, n);
  kernels::Gemm(x_t.rows(), n, x_t.cols(), x_t.Op(),
                ExpertWeightOperand(rows.w, rows.q, e, /*transposed=*/true), OutputOp(out),
                /*accumulate=*/false, path);
}

// The fused gate/up of one tile (CanFuseGateUp): for each block of
// kSwiGluColumns columns, the gate GEMM, the up GEMM, then h = silu(gate)·up
// of the block (skipped when h_t is undefined: a recompute, whose backward
// computes h itself).
void FusedGateUpTile(const InRows& x_t, int64_t e, const ExpertWeights& w, at::Tensor gu_t,
                     const at::Tensor& h_t, kernels::RowPath path, const Packs* gate_packs,
                     const Packs* up_packs) {
  const int64_t inter = w.gate_up_proj.size(1) / 2, rows = x_t.rows();
  const auto gate = Half(w, /*up=*/false), up = Half(w, /*up=*/true);
  for (int64_t c0 = 0; c0 < inter; c0 += kSwiGluColumns) {
    const int64_t n = std::min(kSwiGluColumns, inter - c0);
    HalfMm(gu_t.narrow(1, c0, n), x_t, gate, e, c0, n, path, gate_packs);
    HalfMm(gu_t.narrow(1, inter + c0, n), x_t, up, e, c0, n, path, up_packs);
    if (h_t.defined()) {
      kernels::SiluMul(kernels::ActiveIsa(), rows, n, RowsOf(gu_t, c0), RowsOf(gu_t, inter + c0),
                       RowsOf(h_t, c0));
    }
  }
}

// out = Σ over segments of a_segᵀ · b_seg, in out's dtype (float32 for a
// bfloat16 base: the gradients of its float32 masters).
void BaseGrad(at::Tensor out, const at::Tensor& a, const InRows& b,
              const std::vector<Tile>& segments) {
  bool first = true;
  if (OnKernels(a)) {
    for (const Tile& seg : segments) {
      kernels::Gemm(out.size(0), out.size(1), seg.size,
                    MatrixOp(a.narrow(0, seg.begin, seg.size), true),
                    b.Narrow(seg.begin, seg.size).Op(), OutputOp(out), !first);
      first = false;
    }
    return;
  }
  for (const Tile& seg : segments) {
    at::Tensor a_seg = a.narrow(0, seg.begin, seg.size).t();
    at::Tensor b_seg = b.Tensor().narrow(0, seg.begin, seg.size);
    if (first) {
      MmInto(out, a_seg, b_seg);
      first = false;
    } else {
      out.addmm_(a_seg, b_seg);
    }
  }
}

// out (zero on entry) += Σ over segments of a_segᵀ · b_seg in out's dtype (the
// adapters'), on the float32 kernels (a and b read as float32 as they are
// packed); float64 upcasts in chunks of rows to bound the temporaries.
void LoraGrad(at::Tensor out, const at::Tensor& a, const InRows& b,
              const std::vector<Tile>& segments) {
  if (LoraOnKernels(a, out)) {
    for (const Tile& seg : segments) {
      kernels::Gemm(Float32Isa(), out.size(0), out.size(1), seg.size,
                    MatrixOp(a.narrow(0, seg.begin, seg.size), /*transposed=*/true),
                    b.Narrow(seg.begin, seg.size).Op(), OutputOp(out),
                    /*accumulate=*/true, kernels::RowPath::kBlocked);
    }
    return;
  }
  constexpr int64_t kChunkRows = 1024;
  const at::ScalarType dtype = out.scalar_type();
  for (const Tile& seg : segments) {
    for (int64_t r = 0; r < seg.size; r += kChunkRows) {
      const int64_t n = std::min(kChunkRows, seg.size - r);
      out.addmm_(a.narrow(0, seg.begin + r, n).to(dtype).t(),
                 b.Tensor().narrow(0, seg.begin + r, n).to(dtype));
    }
  }
}

class GroupedBackend final : public ExpertBackend {
 public:
  explicit GroupedBackend(const BackendOptions& options)
      : num_threads_(options.num_threads > 0 ? options.num_threads : at::get_num_threads()),
        arena_(options.thread_pool == ThreadPool::kOneTbb
                   ? std::make_unique<tbb::task_arena>(num_threads_)
                   : nullptr),
        packs_(options.packed_weight_bytes),
        fused_swiglu_(options.fused_swiglu) {}

  std::string_view name() const override { return "grouped"; }
  int64_t kept_pack_bytes() const override { return packs_.bytes(); }

  using ExpertBackend::Backward;
  using ExpertBackend::Forward;

  at::Tensor Forward(const at::Tensor& x_in, const at::Tensor& x_index,
                     const std::vector<int64_t>& counts, const ExpertWeights& w,
                     at::Tensor* activations) override {
    const Input input = MakeInput(x_in, x_index);
    const InRows& xr = input.rows;
    const at::Tensor& x = input.stored;
    const int64_t rows = xr.rows(), inter = w.intermediate();
    const ExpertLora& lora = w.lora;
    at::Tensor gate_up = at::empty({rows, 2 * inter}, x.options());
    at::Tensor h = at::empty({rows, inter}, x.options());
    at::Tensor y = at::empty({rows, w.hidden()}, x.options());
    const std::vector<Tile> tiles =
        RowTiles(counts, w.gate_up_proj.size(0), TileRows(rows, num_threads_));
    const std::vector<kernels::RowPath> paths = ExpertPaths(counts, w.gate_up_proj.size(0));
    const bool fused = fused_swiglu_ && CanFuseGateUp(x, w);
    const GateUpPacks gu_packs = GateUpForwardPacks(w, x, fused);
    const auto down_packs = Lookup(DownOf(w), /*transposed=*/true, x);
    RunTiles(tiles.size(), [&](size_t t) {
      const Tile& tile = tiles[t];
      const int64_t e = tile.expert;
      at::Tensor gu_t = gate_up.narrow(0, tile.begin, tile.size);
      at::Tensor h_t = h.narrow(0, tile.begin, tile.size);
      at::Tensor y_t = y.narrow(0, tile.begin, tile.size);
      const InRows x_t = xr.Narrow(tile.begin, tile.size);
      if (fused) {
        FusedGateUpTile(x_t, e, w, gu_t, h_t, paths[e], gu_packs.gate.get(), gu_packs.up.get());
      } else {
        GateUpTile(x_t, e, w, gu_t, paths[e], gu_packs.whole.get());
        SiluMulTile(gu_t, h_t);
      }
      WeightMm(y_t, h_t, DownOf(w), e, /*transposed=*/true, paths[e], down_packs.get());
      if (lora.has_down()) {
        AddMm(y_t, ScaledMm(h_t, lora.down_a[e].t(), lora.scaling, paths[e]), lora.down_b[e].t(),
              paths[e]);
      }
    });
    if (activations != nullptr) *activations = gate_up;
    return y;
  }

  ExpertGrads Backward(const at::Tensor& grad_y_in, const at::Tensor& x_in,
                       const at::Tensor& x_index, const std::vector<int64_t>& counts,
                       const ExpertWeights& w, const at::Tensor& activations,
                       const BackwardOptions& options) override {
    const Input input = MakeInput(x_in, x_index);
    const InRows& xr = input.rows;
    const at::Tensor& x = input.stored;
    const int64_t rows = xr.rows(), inter = w.intermediate();
    const int64_t hidden = w.hidden();
    const ExpertLora& lora = w.lora;
    const double scale = lora.scaling;
    const bool base = options.base_weight_grads;
    const bool lora_gu = lora.has_gate_up(), lora_down = lora.has_down();
    at::Tensor grad_y = grad_y_in.contiguous();
    // Without saved activations, phase 1 recomputes them tile by tile.
    at::Tensor gate_up =
        activations.defined() ? activations : at::empty({rows, 2 * inter}, x.options());
    // h and d_gate_up are kept whole only when phase 2 reads them; otherwise
    // each tile uses scratch.
    at::Tensor h, d_gate_up;
    if (base || lora_down) h = at::empty({rows, inter}, x.options());
    if (base || lora_gu) d_gate_up = at::empty({rows, 2 * inter}, x.options());
    // The [A, r] low-rank intermediates, recomputed in phase 1 for phase 2:
    // u_gu = s·x·Aguᵀ, du_gu = s·dgu·Bgu, u_down = s·h·Adᵀ, du_down = s·dy·Bd.
    at::Tensor u_gu, du_gu, u_down, du_down;
    ExpertGrads g;
    g.x = at::empty({rows, x.size(1)}, x.options());
    if (base) {
      TORCH_CHECK(w.gate_up_proj.scalar_type() != at::kFloat8_e4m3fn && !w.int4(),
                  "FP8 and int4 expert weights are frozen: they have no weight gradients");
      // A bfloat16 base gets float32 gradients (those of its float32 masters).
      const at::ScalarType grad_dtype =
          w.gate_up_proj.scalar_type() == at::kBFloat16 ? at::kFloat : w.gate_up_proj.scalar_type();
      // Written whole by phase 2 for every expert with rows (its first
      // segment overwrites); only the others are zeroed, below.
      g.gate_up_proj =
          at::empty(w.gate_up_proj.sizes(), w.gate_up_proj.options().dtype(grad_dtype));
      g.down_proj = at::empty(w.down_proj.sizes(), w.down_proj.options().dtype(grad_dtype));
    }
    if (lora_gu) {
      const at::TensorOptions o = lora.gate_up_a.options();
      u_gu = at::empty({rows, lora.gate_up_a.size(1)}, o);
      du_gu = at::empty({rows, lora.gate_up_a.size(1)}, o);
      g.gate_up_a = at::zeros_like(lora.gate_up_a);
      g.gate_up_b = at::zeros_like(lora.gate_up_b);
    }
    if (lora_down) {
      const at::TensorOptions o = lora.down_a.options();
      u_down = at::empty({rows, lora.down_a.size(1)}, o);
      du_down = at::empty({rows, lora.down_a.size(1)}, o);
      g.down_a = at::zeros_like(lora.down_a);
      g.down_b = at::zeros_like(lora.down_b);
    }

    // Phase 1, per row tile: (gate/up if recomputed), dh, the fused SwiGLU
    // derivative, dx, each with its LoRA term, and the low-rank intermediates.
    const int64_t num_experts = w.gate_up_proj.size(0);
    const std::vector<Tile> tiles = RowTiles(counts, num_experts, TileRows(rows, num_threads_));
    const std::vector<kernels::RowPath> paths = ExpertPaths(counts, num_experts);
    // The forward orientation only when the gate/up GEMM is recomputed.
    const bool fused = fused_swiglu_ && CanFuseGateUp(x, w);
    const GateUpPacks gu_fwd_packs =
        activations.defined() ? GateUpPacks{} : GateUpForwardPacks(w, x, fused);
    const auto gate_up_packs = Lookup(GateUpOf(w), /*transposed=*/false, x);
    const auto down_packs = Lookup(DownOf(w), /*transposed=*/false, x);
    RunTiles(tiles.size(), [&](size_t t) {
      const Tile& tile = tiles[t];
      const int64_t e = tile.expert;
      auto rows_of = [&](const at::Tensor& full, int64_t cols) {
        return full.defined() ? full.narrow(0, tile.begin, tile.size)
                              : at::empty({tile.size, cols}, x.options());
      };
      const InRows x_t = xr.Narrow(tile.begin, tile.size);
      at::Tensor dy_t = grad_y.narrow(0, tile.begin, tile.size);
      at::Tensor gu_t = gate_up.narrow(0, tile.begin, tile.size);
      if (!activations.defined()) {
        at::Tensor u;
        if (fused) {
          FusedGateUpTile(x_t, e, w, gu_t, at::Tensor(), paths[e], gu_fwd_packs.gate.get(),
                          gu_fwd_packs.up.get());
        } else {
          u = GateUpTile(x_t, e, w, gu_t, paths[e], gu_fwd_packs.whole.get());
        }
        if (lora_gu) u_gu.narrow(0, tile.begin, tile.size).copy_(u);
      } else if (lora_gu) {
        u_gu.narrow(0, tile.begin, tile.size)
            .copy_(ScaledMm(x_t, lora.gate_up_a[e].t(), scale, paths[e]));
      }
      at::Tensor dh_t = at::empty({tile.size, inter}, x.options());
      WeightMm(dh_t, dy_t, DownOf(w), e, /*transposed=*/false, paths[e], down_packs.get());
      if (lora_down) {
        at::Tensor du = ScaledMm(dy_t, lora.down_b[e], scale, paths[e]);
        AddMm(dh_t, du, lora.down_a[e], paths[e]);
        du_down.narrow(0, tile.begin, tile.size).copy_(du);
      }
      at::Tensor h_t = rows_of(h, inter);
      at::Tensor dgu_t = rows_of(d_gate_up, 2 * inter);
      if (OnKernels(x)) {
        kernels::SiluMulBackward(SwiGluIsa(), tile.size, inter, RowsOf(gu_t), RowsOf(gu_t, inter),
                                 RowsOf(dh_t), RowsOf(h_t), RowsOf(dgu_t), RowsOf(dgu_t, inter));
      } else {
        SiluMulBackwardDouble(gu_t, dh_t, h_t, dgu_t);
      }
      if (lora_down) {
        u_down.narrow(0, tile.begin, tile.size)
            .copy_(ScaledMm(h_t, lora.down_a[e].t(), scale, paths[e]));
      }
      at::Tensor dx_t = g.x.narrow(0, tile.begin, tile.size);
      WeightMm(dx_t, dgu_t, GateUpOf(w), e, /*transposed=*/false, paths[e], gate_up_packs.get());
      if (lora_gu) {
        at::Tensor du = ScaledMm(dgu_t, lora.gate_up_b[e], scale, paths[e]);
        AddMm(dx_t, du, lora.gate_up_a[e], paths[e]);
        du_gu.narrow(0, tile.begin, tile.size).copy_(du);
      }
    });

    // Phase 2, per (expert, gradient, block of its long dimension): each
    // weight gradient is d_outᵀ · in summed over the expert's segments.
    // Splitting the long dimension keeps a hot expert parallel. With a frozen
    // base only the (cheap, rank-r) LoRA gradients run.
    std::vector<std::vector<Tile>> segments(num_experts);  // per expert: its row ranges
    std::vector<int64_t> expert_rows(num_experts, 0);
    int64_t row = 0;
    for (size_t s = 0; s < counts.size(); ++s) {
      if (counts[s] > 0) {
        const int64_t e = static_cast<int64_t>(s) % num_experts;
        segments[e].push_back({e, row, counts[s]});
        expert_rows[e] += counts[s];
      }
      row += counts[s];
    }
    enum class Grad { kDown, kGateUp, kDownA, kDownB, kGateUpA, kGateUpB };
    struct WeightTile {
      Grad grad;
      int64_t expert, begin, size;
      int64_t cost;  // the expert's rows x the block's extent x the gradient's other side
    };
    std::vector<WeightTile> wtiles;
    constexpr int64_t kWeightRows = 512;
    // Blocks of `extent` (the gradient's long side); `other` is its other
    // side, the rank r for the LoRA factors.
    auto add_blocks = [&](Grad grad, int64_t e, int64_t extent, int64_t other) {
      for (int64_t r = 0; r < extent; r += kWeightRows) {
        const int64_t n = std::min(kWeightRows, extent - r);
        wtiles.push_back({grad, e, r, n, expert_rows[e] * n * other});
      }
    };
    for (int64_t e = 0; e < num_experts; ++e) {
      if (segments[e].empty()) {
        if (base) {
          g.gate_up_proj[e].zero_();
          g.down_proj[e].zero_();
        }
        continue;
      }
      if (base) {
        add_blocks(Grad::kDown, e, hidden, inter);
        add_blocks(Grad::kGateUp, e, 2 * inter, hidden);
      }
      if (lora_down) {
        const int64_t r = lora.down_a.size(1);
        add_blocks(Grad::kDownB, e, hidden, r);
        add_blocks(Grad::kDownA, e, inter, r);
      }
      if (lora_gu) {
        const int64_t r = lora.gate_up_a.size(1);
        add_blocks(Grad::kGateUpB, e, 2 * inter, r);
        add_blocks(Grad::kGateUpA, e, hidden, r);
      }
    }
    LargestFirst(wtiles, [](const WeightTile& wt) { return wt.cost; });
    RunTiles(wtiles.size(), [&](size_t t) {
      const WeightTile& wt = wtiles[t];
      const std::vector<Tile>& segs = segments[wt.expert];
      const int64_t e = wt.expert, b = wt.begin, n = wt.size;
      switch (wt.grad) {
        case Grad::kDown:  // dyᵀ · h
          BaseGrad(g.down_proj[e].narrow(0, b, n), grad_y.narrow(1, b, n), h, segs);
          break;
        case Grad::kGateUp:  // dguᵀ · x
          BaseGrad(g.gate_up_proj[e].narrow(0, b, n), d_gate_up.narrow(1, b, n), xr, segs);
          break;
        case Grad::kDownB:  // s·dyᵀ · (h·Adᵀ)
          LoraGrad(g.down_b[e].narrow(0, b, n), grad_y.narrow(1, b, n), u_down, segs);
          break;
        case Grad::kDownA:  // (s·dy·Bd)ᵀ · h
          LoraGrad(g.down_a[e].narrow(1, b, n), du_down, h.narrow(1, b, n), segs);
          break;
        case Grad::kGateUpB:  // s·dguᵀ · (x·Aguᵀ)
          LoraGrad(g.gate_up_b[e].narrow(0, b, n), d_gate_up.narrow(1, b, n), u_gu, segs);
          break;
        case Grad::kGateUpA:  // (s·dgu·Bgu)ᵀ · x
          LoraGrad(g.gate_up_a[e].narrow(1, b, n), du_gu, xr.Columns(b, n), segs);
          break;
      }
    });
    return g;
  }

 private:
  // The forward gate/up GEMM's packs: of each half for the fused path, of
  // the whole weight otherwise.
  struct GateUpPacks {
    std::shared_ptr<const Packs> whole, gate, up;
  };
  GateUpPacks GateUpForwardPacks(const ExpertWeights& w, const at::Tensor& x, bool fused) {
    GateUpPacks p;
    if (fused) {
      p.gate = Lookup(Half(w, /*up=*/false), /*transposed=*/true, x);
      p.up = Lookup(Half(w, /*up=*/true), /*transposed=*/true, x);
    } else {
      p.whole = Lookup(GateUpOf(w), /*transposed=*/true, x);
    }
    return p;
  }

  // The instruction set of SwiGLU's kernels: the active one's vector exp, or,
  // with fused_swiglu off, the portable kernels' scalar std::exp (the twin
  // the vector ones are tested against).
  kernels::Isa SwiGluIsa() const {
    return fused_swiglu_ ? kernels::ActiveIsa() : kernels::Isa::kPortable;
  }

  // h = silu(gate)·up over one tile of gate_up = [gate | up].
  void SiluMulTile(const at::Tensor& gu_t, const at::Tensor& h_t) const {
    if (!OnKernels(gu_t)) {
      SiluMulDouble(gu_t, h_t);
      return;
    }
    const int64_t inter = h_t.size(1);
    kernels::SiluMul(SwiGluIsa(), h_t.size(0), inter, RowsOf(gu_t), RowsOf(gu_t, inter),
                     RowsOf(h_t));
  }

  // w's packs for the kernels that will multiply x's rows by it (null: the
  // GEMMs pack per call).
  std::shared_ptr<const Packs> Lookup(const Matrix& m, bool transposed, const at::Tensor& x) {
    if (!OnKernels(x)) return nullptr;
    return packs_.Lookup(m.w, m.q, transposed, kernels::ActiveIsa(), KernelType(x.scalar_type()));
  }

  // fn(t) for every tile t < num_tiles, in parallel, each tile whole on one
  // thread, handed out one at a time (skewed routing makes some tiles slow).
  template <typename Fn>
  void RunTiles(size_t num_tiles, const Fn& fn) {
    if (num_tiles == 0) return;
    SingleThreadedTorch single;
    // Workers run ATen ops: give them the caller's grad mode and dispatch
    // state (inside an autograd function, autograd must stay off there too).
    const at::ThreadLocalState state;
    if (arena_ != nullptr) {
      arena_->execute([&] {
        tbb::parallel_for(tbb::blocked_range<size_t>(0, num_tiles, 1),
                          [&](const tbb::blocked_range<size_t>& r) {
                            at::ThreadLocalStateGuard guard(state);
                            MakeWorkerSingleThreaded();
                            for (size_t t = r.begin(); t != r.end(); ++t) fn(t);
                          });
      });
      return;
    }
    // On the OpenMP pool the dense layers use, so that no second pool's
    // threads compete with its spinning ones for the cores. An exception may
    // not leave the parallel region: the first is kept, the remaining tiles
    // are skipped, and it is thrown here.
    const int threads = static_cast<int>(std::min<size_t>(num_threads_, num_tiles));
    std::exception_ptr error;
    std::atomic<bool> failed{false};
#pragma omp parallel num_threads(threads)
    {
      at::ThreadLocalStateGuard guard(state);
#pragma omp for schedule(dynamic, 1)
      for (size_t t = 0; t < num_tiles; ++t) {
        if (failed.load(std::memory_order_relaxed)) continue;
        try {
          fn(t);
        } catch (...) {
          if (!failed.exchange(true)) error = std::current_exception();
        }
      }
    }
    if (error) std::rethrow_exception(error);
  }

  int num_threads_;
  std::unique_ptr<tbb::task_arena> arena_;  // ThreadPool::kOneTbb only
  PackedWeightCache packs_;
  bool fused_swiglu_;
};

}  // namespace

std::unique_ptr<ExpertBackend> CreateGroupedBackend(const BackendOptions& options) {
  return std::make_unique<GroupedBackend>(options);
}

}  // namespace moefit::experts
