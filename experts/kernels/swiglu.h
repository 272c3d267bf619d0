// SwiGLU's activation, h = silu(gate) ⊙ up, and its backward, over rows of
// float32 or bfloat16, with each instruction set's vector exp: the expert
// layer applies it to a block of gate/up columns right after the GEMMs that
// produce them, while they are still in cache.
//
// Numerics: computed in float32 (bfloat16 inputs converted exactly, outputs
// rounded once to nearest even). The portable kernels use std::exp; the
// vector ones a polynomial exp a few units in the last place off, so results
// differ from the portable ones by a few float32 units in the last place
// (relative to the magnitudes of the terms), by one bfloat16 unit where that
// moves a rounding boundary.
#pragma once

#include <cstdint>

#include "experts/kernels/gemm.h"

namespace moefit::experts::kernels {

// Rows of n elements at data + i * row_stride (in elements of `type`,
// float32 or bfloat16).
struct Rows {
  void* data = nullptr;
  ElemType type = ElemType::kF32;
  int64_t row_stride = 0;
};

// h = silu(gate) · up over m x n; h may not overlap gate or up.
void SiluMul(Isa isa, int64_t m, int64_t n, const Rows& gate, const Rows& up, const Rows& h);

// From gate, up and dh: h = silu(gate) · up, d_gate = dh · up · silu'(gate),
// d_up = dh · silu(gate), over m x n.
void SiluMulBackward(Isa isa, int64_t m, int64_t n, const Rows& gate, const Rows& up,
                     const Rows& dh, const Rows& h, const Rows& d_gate, const Rows& d_up);

}  // namespace moefit::experts::kernels
