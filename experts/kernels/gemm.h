// moefit's own GEMM for the expert layers: float32 accumulation over operands
// stored as float32, bfloat16, FP8 e4m3 with block scales or 4-bit integers
// with group scales, converted block by block as they are packed (or, for a
// few rows, in registers as they are streamed), never as a whole tensor.
//
// Why not LibTorch's mm: on CPUs without AVX-512 BF16 the wheel's bfloat16
// GEMM has no fast kernel (far slower than its float32 one), it has no
// FP8 GEMM at all, and the expert layer calls it thousands of times per step
// on small per-expert blocks. Here:
//   * The operands are strided views (any layout, transposed or not, in the
//     dtype they are stored in), so the expert layer multiplies its packed
//     weights [E, 2I, H] / [E, H, I] in both orientations without copies.
//   * Blocking is GotoBLAS-style: a KB x NB block of B (the weight, in the
//     expert layer) is packed once into the microkernel's layout -- converted
//     to float32, or to bfloat16 pairs for vdpbf16ps -- and reused for every
//     row of A (every token routed to that expert): weight-stationary.
//   * One call runs on the calling thread. The expert layer parallelises over
//     (expert, row block) itself, so that skewed routing keeps every core busy.
//
// Numerics: products accumulate in float32. An int4 element is worth
// bfloat16((q - z) x scale) on every instruction set -- the value its
// checkpoint's own decompression gives -- so an int4 weight multiplies as
// its bfloat16 dequantization everywhere, bit for bit. On avx512_bf16 and amx_bf16,
// when B is bfloat16 or FP8, FP8 x scale is rounded to bfloat16 as it is
// packed (and as it is streamed for a few rows), so an FP8 weight multiplies
// exactly as its bfloat16 dequantization; where they multiply bfloat16 pairs
// (MultipliesBf16Pairs) the blocked path rounds A to bfloat16 (round to
// nearest even) as well, and the streamed one keeps A in float32.
// Everywhere else every input is converted exactly to float32. The summation
// order depends on the instruction set, not on the thread count or on the
// other rows.
#pragma once

#include <cstdint>
#include <memory>

#include "experts/kernels/isa.h"

namespace moefit::experts::kernels {

enum class ElemType : uint8_t {
  kF32,     // float
  kBF16,    // bfloat16, as uint16_t bits
  kF8E4M3,  // float8_e4m3fn, as uint8_t bits (no infinities; 0x7f/0xff are NaN)
  kI4,      // signed 4-bit integers with group scales, two per byte (see Operand)
};

// Whether an element type is only ever a weight (B): FP8 and int4 operands
// need their scales per element and are never activations.
constexpr bool WeightOnly(ElemType t) { return t == ElemType::kF8E4M3 || t == ElemType::kI4; }

// Read-only 2-D operand: element (i, j) is data[i * row_stride + j * col_stride]
// (in elements of `type`). FP8 operands carry float32 block scales: element
// (i, j) stands for fp8 * scales[(i / 128) * scale_row_stride + (j / 128) *
// scale_col_stride], DeepSeek-V3's 128x128 weight blocks.
//
// Rows picked by index: with row_index set, row i is the stored row
// row_index[i] -- element (i, j) is data[row_index[i] * row_stride + j *
// col_stride] -- so the rows of a matrix can be multiplied in any order and
// any number of times each without being copied out first (the expert layer
// reads a token's row once per expert it visits from one received row). The
// driver copies the block of rows it is about to pack into a small buffer of
// the calling thread, so the products are the bits of the same rows stored
// one after another. float32 and bfloat16 operands only (FP8 scales follow
// the stored rows' blocks), and not in a PackedB.
//
// int4 operands (compressed-tensors' pack-quantized weights, as Kimi-K2-
// Thinking stores its routed experts): strides and offsets count 4-bit
// elements (nibbles), two per byte, the low nibble first, so element (i, j)
// is nibble i * row_stride + j * col_stride of `data`. A nibble holds u = q + 8
// for q in [-8, 7]. Elements come in groups of group_rows x group_cols (one
// row and G consecutive inputs of a weight [out, in]: 1 x G read as W, G x 1
// read as Wᵀ), group (i / group_rows, j / group_cols) at g = (i / group_rows)
// * scale_row_stride + (j / group_cols) * scale_col_stride, with a bfloat16
// scale group_scales[g] and, for asymmetric schemes, a zero point
// zero_points[g] (0 where zero_points is null). The element stands for
// bfloat16((q - z) x scale), rounded once: what the checkpoint's library
// dequantizes it to. The strides and a group's extent along the nibbles'
// dimension are even, so each group's elements start on a byte.
struct Operand {
  const void* data = nullptr;
  ElemType type = ElemType::kF32;
  int64_t row_stride = 0;
  int64_t col_stride = 1;
  const float* scales = nullptr;
  int64_t scale_row_stride = 0;
  int64_t scale_col_stride = 0;
  const int64_t* row_index = nullptr;
  // int4 only.
  const uint16_t* group_scales = nullptr;
  const int8_t* zero_points = nullptr;
  int64_t group_rows = 1;
  int64_t group_cols = 1;
};

inline constexpr int64_t kScaleBlock = 128;

// Row-major output: element (i, j) at data[i * row_stride + j]; float32 or
// bfloat16 (rounded once, after the whole sum).
struct Output {
  void* data = nullptr;
  ElemType type = ElemType::kF32;
  int64_t row_stride = 0;
};

// Up to this many rows of A, B can be streamed unpacked (matrix-vector
// products at memory speed) instead of packed and blocked.
inline constexpr int64_t kMaxStreamedRows = 8;

// Which of the two paths a call takes. Each computes every row of C from that
// row of A alone, but the two sum in different orders (and the streamed one
// never rounds A to bfloat16), so a caller that needs a row's result not to
// depend on how many rows share its call picks the path itself: the expert
// layer decides per expert, by the expert's rows in all, so that the same
// tokens give the same outputs however they are split into segments and
// tiles (one process or several).
enum class RowPath : uint8_t {
  kAuto,      // streamed when m <= kMaxStreamedRows and the layout allows it
  kBlocked,   // always packed and blocked
  kStreamed,  // streamed where the layout allows it (m <= kMaxStreamedRows)
};

// C[i, j] = (accumulate ? C[i, j] : 0) + sum_k A[i, k] * B[k, j] for i < m,
// j < n, k < k_size, on the calling thread, with ActiveIsa()'s kernels (or
// `isa`'s, which must not be wider than DetectIsa()). k_size may be 0 (C
// becomes 0, or stays). C must not overlap A or B.
void Gemm(int64_t m, int64_t n, int64_t k_size, const Operand& a, const Operand& b, const Output& c,
          bool accumulate, RowPath path = RowPath::kAuto);
void Gemm(Isa isa, int64_t m, int64_t n, int64_t k_size, const Operand& a, const Operand& b,
          const Output& c, bool accumulate, RowPath path = RowPath::kAuto);

namespace internal {
struct PackedKernels;
}

// B (k_size x n) packed once, ahead of the calls that multiply by it, in the
// panels that one instruction set's blocked path packs it into call by call:
// the expert layer packs each weight once per optimizer step (trainable) or
// once at load (frozen) instead of once per GEMM. Gemm with a PackedB gives
// the same bits as Gemm with its source operand. The source stays referenced
// (not copied): the streamed path and calls on another instruction set read
// it, so it must outlive the PackedB and must not change while it is used
// -- the caller rebuilds the pack when the weights change.
//
// Memory: k_size x n rounded up to the microkernel's panels, 4 bytes per
// element in float32 mode (float32 weights, or any weight on AVX2, AVX-512F,
// portable and widened avx512_bf16 kernels) and 2 in bfloat16-pairs mode
// (bfloat16 weights where MultipliesBf16Pairs). An FP8 weight there keeps
// its one byte per element (when n is a multiple of 32 and k_size even),
// in the panels' order: each k block's panels are converted to bfloat16
// pairs as a GEMM reads them, a contiguous pass through the kept bytes
// instead of a pack from the weight's own layout. An int4 weight's pack is
// its bfloat16 dequantization's (the same panels, the same size).
class PackedB {
 public:
  PackedB() = default;
  // Packs for `isa`'s kernels, multiplied by an A of type a_type.
  PackedB(Isa isa, ElemType a_type, int64_t k_size, int64_t n, const Operand& b);

  // The bytes such a pack takes (what the constructor allocates).
  static int64_t Bytes(Isa isa, ElemType a_type, int64_t k_size, int64_t n, ElemType b_type);

  bool empty() const { return kern_ == nullptr; }
  int64_t bytes() const { return num_floats_ * static_cast<int64_t>(sizeof(float)); }
  int64_t k_size() const { return k_size_; }
  int64_t n() const { return n_; }
  const Operand& source() const { return source_; }

 private:
  friend void GemmColumns(Isa isa, int64_t m, const Operand& a, const PackedB& b, int64_t col0,
                          int64_t num_cols, const Output& c, bool accumulate, RowPath path);
  // The panels of columns [n0, n0 + n_block) (n0 on the panel grid) of the
  // k block [k0, k0 + k_block): where they lie in the pack, or, from a
  // compact FP8 pack, converted into `scratch` (room for them).
  const float* Block(int64_t k0, int64_t n0, float* scratch, int64_t k_block,
                     int64_t n_block) const;

  const internal::PackedKernels* kern_ = nullptr;
  Isa isa_ = Isa::kPortable;
  ElemType a_type_ = ElemType::kF32;
  int64_t k_size_ = 0, n_ = 0;
  // 4-byte panel slots per full k block (all column panels); a compact FP8
  // pack holds two bytes per slot.
  int64_t block_slots_ = 0;
  bool compact_ = false;
  Operand source_;
  // Written whole by the packing, so not value-initialized first.
  std::unique_ptr<float[]> data_;
  int64_t num_floats_ = 0;
};

// C = (accumulate ? C : 0) + A · B with B packed ahead (m x b.n() over
// b.k_size()). Same bits as Gemm(isa, m, b.n(), b.k_size(), a,
// b.source(), c, accumulate, path); where the pack does not fit the call
// (another instruction set or A's type) that Gemm runs instead.
void Gemm(Isa isa, int64_t m, const Operand& a, const PackedB& b, const Output& c, bool accumulate,
          RowPath path = RowPath::kAuto);

// The same for columns [col0, col0 + num_cols) of B only (c points at the
// output of column col0): the bits of those columns of the whole product.
// With FP8 B, col0 is a multiple of kScaleBlock; with int4 B, of its groups'
// columns (group_cols) and even.
void GemmColumns(Isa isa, int64_t m, const Operand& a, const PackedB& b, int64_t col0,
                 int64_t num_cols, const Output& c, bool accumulate, RowPath path = RowPath::kAuto);

// The float32 value of one element, by c10's conversions (the reference the
// kernels' packing is tested against).
float ElementValue(const Operand& op, int64_t i, int64_t j);

}  // namespace moefit::experts::kernels
