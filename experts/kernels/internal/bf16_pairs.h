// How the avx512_bf16 kernels multiply bfloat16 and FP8 weights in their
// blocked path: as bfloat16 pairs (vdpbf16ps) or widened to float32 (the
// avx512 kernels). vdpbf16ps does twice a float32 FMA's multiply-adds
// per instruction, but not every CPU issues it as often: on some (AMD Zen 5)
// bfloat16 weights run faster through it than widened to float32, on others
// (an Emerald Rapids Xeon without AMX) it issues at a quarter of the FMA's
// rate, half the multiply-adds per second. So the choice is measured, once
// per process, and the kernels follow it (MultipliesBf16Pairs in isa.h).
#pragma once

#include <optional>

namespace moefit::experts::kernels::internal {

// vdpbf16ps's multiply-adds per second over vfmadd231ps's on the calling
// core (both 512-bit, many independent accumulators), from a short timing
// loop.
// Only where the CPU has AVX-512 BF16.
double MeasureBf16PairSpeed();

// Holds avx512_bf16 to one form (true: pairs, false: widened) in this
// process, or back to the measured choice (nullopt): for the tests and
// benchmarks that compare the two.
void SetBf16Pairs(std::optional<bool> pairs);

}  // namespace moefit::experts::kernels::internal
