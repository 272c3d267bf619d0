// Which x86 vector instruction set the expert kernels use, chosen at run time.
//
// moefit is built for the baseline x86-64 target and runs on any x86-64 CPU;
// the kernels for wider instruction sets are compiled separately (each file
// with its own target flags) and chosen here by what the CPU and the operating
// system support. Ordered from narrowest to widest: a process may be held to a
// narrower set than the CPU has (MOEFIT_CPU_ISA, or LimitIsa in tests), never
// a wider one.
//
//   portable     plain C++ (the compiler's baseline SSE2)
//   avx2         AVX2 + FMA, 256-bit fp32 FMAs
//   avx512       AVX-512 F/BW/VL, 512-bit fp32 FMAs
//   avx512_bf16  AVX-512 BF16: bfloat16 weights multiplied with vdpbf16ps
//                (two bfloat16 products summed into fp32 per lane), the
//                activations rounded to bfloat16 for it -- or, on CPUs
//                where that gives fewer multiply-adds per second than
//                float32 FMAs, the same weight values widened to float32
//                (MultipliesBf16Pairs)
//   amx_bf16     AMX-BF16 tiles (Sapphire Rapids and later): bfloat16 weights
//                multiplied 16 x 16 x 32 at a time with tdpbf16ps, the
//                activations rounded to bfloat16 as for avx512_bf16; float32
//                products still run the avx512 kernels. Needs the kernel's
//                permission for the tile state (Linux 5.16+), asked once.
#pragma once

#include <string>
#include <string_view>

namespace moefit::experts::kernels {

enum class Isa { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmxBf16 = 4 };

// Every set, narrowest first.
inline constexpr Isa kAllIsas[] = {Isa::kPortable, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16,
                                   Isa::kAmxBf16};

// Whether `isa` multiplies bfloat16 and FP8 weights as bfloat16 values (FP8
// x scale rounded to bfloat16, so an FP8 weight gives the bits of its
// bfloat16 dequantization) rather than converting FP8 x scale to float32
// unrounded: the sets from avx512_bf16 up.
inline bool MultipliesInBf16(Isa isa) { return isa >= Isa::kAvx512Bf16; }

// Whether `isa`'s blocked path (more than a few rows) multiplies bfloat16 and
// FP8 weights as bfloat16 pairs, rounding the activations to bfloat16 for
// it: amx_bf16 always; avx512_bf16 where this CPU's vdpbf16ps gives more
// multiply-adds per second than its float32 FMA (Bf16PairSpeed() > 1), else
// it widens the weights to float32 and keeps the activations in float32.
bool MultipliesBf16Pairs(Isa isa);

// vdpbf16ps's multiply-adds per second over float32 FMA's on this CPU,
// measured once per process on the first call (a short timing loop); 0 on a CPU
// without AVX-512 BF16. For logs and benchmark reports.
double Bf16PairSpeed();

// IsaName, and for avx512_bf16 the form it multiplies in, e.g.
// "avx512_bf16 (weights widened to float32: vdpbf16ps at R x the FMA's
// multiply-adds per second)", and, where the set streams a few rows of FP8
// weights through lookup tables, the rows up to which it does ("; FP8
// lookup tables up to 6 rows in forward GEMMs, 8 in dX", measured on first
// use): what moefit prints at start-up.
std::string IsaDescription(Isa isa);

// "portable", "avx2", "avx512", "avx512_bf16", "amx_bf16".
std::string_view IsaName(Isa isa);

// The widest set this CPU and OS support.
Isa DetectIsa();

// The set the kernels use: DetectIsa(), held narrower by the environment
// variable MOEFIT_CPU_ISA (one of the names above) or by LimitIsa. A name
// that is unknown, or wider than the CPU supports, throws (c10::Error) with
// the supported names.
Isa ActiveIsa();

// Holds the kernels to at most `isa` (clamped to DetectIsa()) from now on, in
// this process: for tests that run each narrower path on a wider CPU.
void LimitIsa(Isa isa);

// The CPU's vector flags relevant here, e.g. "avx2 fma avx512f avx512bw
// avx512vl avx512_bf16 avx512_vbmi amx_bf16", for logs and benchmark
// reports (avx512_vbmi: the FP8 lookup tables, internal/fp8_tables.h).
std::string CpuFlags();

}  // namespace moefit::experts::kernels
