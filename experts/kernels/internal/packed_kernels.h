// The pieces each instruction set provides to the blocked GEMM driver
// (gemm.cc): packing of A and B blocks into the microkernel's panels, and the
// microkernel itself.
//
// Panels. A block of A (rows m0.., k0..) is cut into panels of mr rows and B
// (k0.., columns n0..) into panels of nr columns, each stored k-major so the
// microkernel streams through both with unit stride:
//   float32 mode:  A panel [kb][mr] floats,        B panel [kb][nr] floats
//   pairs mode:    A panel [kp][mr] bf16 pairs,    B panel [kp][nr] bf16 pairs
// with kp = ceil(kb / 2), a pair being (k even, k odd) in one 32-bit word, as
// vdpbf16ps reads them. A kernel may round kp up to a multiple of its
// k_pad_pairs (AMX: 16, a whole tile), the pairs past the block zero, and
// lay its A panel out otherwise within the same size (AMX: [kp / 16][mr][16]
// pairs, each tile row contiguous). Rows of A beyond the block and columns of B beyond it
// are zero, so a microkernel may run whole panels and store only the block's
// part; it may also skip what lies wholly outside the block (the float32
// kernels' unused half of a B panel, AMX's unused tiles).
//
// Every file that implements an instruction set is compiled with that set's
// target flags and includes internal/pack_common.h, whose functions have
// internal linkage: no code built for a wider set can be picked by the linker
// for a caller on a narrower CPU.
#pragma once

#include <cstdint>

#include "experts/kernels/gemm.h"

namespace moefit::experts::kernels::internal {

struct PackedKernels {
  const char* name;
  int mr, nr;          // microkernel tile
  int64_t kb, nb, mb;  // block sizes (nb a multiple of nr, mb of mr, kb even)
  bool pairs;          // bfloat16 pairs mode (vdpbf16ps), else float32
  void (*pack_a)(const Operand& a, int64_t m0, int64_t m_size, int64_t k0, int64_t k_size,
                 void* out);
  void (*pack_b)(const Operand& b, int64_t k0, int64_t k_size, int64_t n0, int64_t n_size,
                 void* out);
  // C[rows, cols] (float32, row stride ldc) = (accumulate ? C : 0) + A panel
  // x B panel over k_size; rows <= mr, cols <= nr.
  void (*micro)(int64_t k_size, const void* a_panel, const void* b_panel, float* c, int64_t ldc,
                int rows, int cols, bool accumulate);
  // Optional (may be null): the whole GEMM for a few rows of A, streaming B
  // without packing it (memory-bound matrix-vector products). Returns false
  // when it does not take the call; the blocked path then runs.
  bool (*small_rows)(int64_t m, int64_t n, int64_t k_size, const Operand& a, const Operand& b,
                     const Output& c, bool accumulate);
  // SwiGLU's activation over one float32 row of n (swiglu.h): h = silu(g)·u,
  // and its backward (h again, dg, du from dh).
  void (*silu_mul)(const float* g, const float* u, float* h, int64_t n);
  void (*silu_mul_backward)(const float* g, const float* u, const float* dh, float* h, float* dg,
                            float* du, int64_t n);
  // The softmax's exponentials over one float32 row of n (exp_sum.h):
  // x[j] = exp(x[j] * scale - shift); returns their sum.
  float (*exp_sum)(float* x, int64_t n, float scale, float shift);
  // A float32 row written to a bfloat16 output (round to nearest even),
  // added to it when accumulating: how the driver writes a bfloat16 C.
  void (*store_bf16)(const float* src, uint16_t* out, int64_t n, bool accumulate);
  // Pairs mode: panels hold their pairs rounded up to a multiple of this.
  int k_pad_pairs = 1;
  // Optional: run by the driver on its thread before the first microkernel
  // of a call and after the last (AMX: load the tile configuration, release
  // the tiles).
  void (*begin)() = nullptr;
  void (*end)() = nullptr;
  // Optional (pairs mode): an FP8 B kept compactly, in the pairs panels'
  // order with one byte per element instead of a bfloat16 pair per 4 bytes
  // (PackedB, gemm.cc), expanded into the panels pack_b makes of the same
  // block, the same bits: the panels of columns [n0, n0 + n_size) (n0 a
  // multiple of nr; the last panel whole) of the k block [k0, k0 + k_size)
  // (k_size even), read from `compact`, their first byte. b is the FP8
  // source, for its scales.
  void (*expand_fp8)(const uint8_t* compact, const Operand& b, int64_t k0, int64_t k_size,
                     int64_t n0, int64_t n_size, void* out) = nullptr;
};

// Floats (4-byte slots) per row or column of a panel over a k block of kb.
inline int64_t PanelSlots(const PackedKernels& kern, int64_t kb) {
  if (!kern.pairs) return kb;
  const int64_t kp = (kb + 1) / 2;
  return (kp + kern.k_pad_pairs - 1) / kern.k_pad_pairs * kern.k_pad_pairs;
}

// The avx512 float32 microkernel's tile (kernels_avx512.cc), whose panels
// avx512_bf16's widened kernels pack too.
inline constexpr int kAvx512F32Mr = 12;
inline constexpr int kAvx512F32Nr = 32;

const PackedKernels& PortableF32Kernels();
const PackedKernels& Avx2F32Kernels();
const PackedKernels& Avx512F32Kernels();
const PackedKernels& Avx512Bf16PairKernels();
const PackedKernels& Avx512Bf16WidenedKernels();
const PackedKernels& AmxBf16Kernels();

// The kernels `isa` multiplies with: when `narrow` (a bfloat16 or FP8
// operand), its bfloat16-pairs kernels where it multiplies in pairs
// (MultipliesBf16Pairs), avx512_bf16's widened ones where it does not; else
// its float32 ones.
const PackedKernels& KernelsFor(Isa isa, bool narrow);

}  // namespace moefit::experts::kernels::internal
