// The softmax's exponentials over a float32 row with each instruction set's
// vector exp (the one SwiGLU's activation uses, swiglu.h), for attention's
// softmax (framework/causal_attention.h).
//
// Numerics: the vector kernels' exp is a few float32 units in the last place
// off std::exp (the portable kernels'), and clamped below at about -87.3, so
// an exponent below that gives about 1e-38 rather than a smaller number or 0.
#pragma once

#include <cstdint>

#include "experts/kernels/isa.h"

namespace moefit::experts::kernels {

// x[j] = exp(x[j] * scale - shift) for j < n, in place; returns their sum.
float ExpSum(Isa isa, float* x, int64_t n, float scale, float shift);

}  // namespace moefit::experts::kernels
