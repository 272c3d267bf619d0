// FP8 weights streamed through per-block lookup tables, for the kernels that
// multiply bfloat16 pairs (avx512_bf16, amx_bf16) on CPUs that also have
// AVX-512 VBMI (Sapphire Rapids and later, AMD Zen 4 and later: each CPU with
// AVX-512 BF16 but Cooper Lake).
//
// For a few rows the expert GEMM should run at the speed of reading the
// weight, and an FP8 weight is half the bytes of a bfloat16 one. But on these
// sets the streamed path (SmallRows<true>, pack_x86.h) multiplies every FP8
// element as bfloat16(e4m3 x block scale), and decoding, scaling and rounding
// take about a dozen vector instructions per 16 elements: FP8 ran slower than
// bfloat16. Within one 128 x 128 scale block each of the 256 byte values
// stands for one bfloat16, and a byte with the sign bit set for the negation
// of the one without (bar the NaN byte), so the 128 results of the bytes
// below 128 are made once per block, with SmallRows<true>'s own decoder (the
// same bits for every byte and scale), and each 64 bytes of weight become 64
// floats by byte permutes (vpermt2b).
//
// The same tables expand the compact packs that keep FP8 weights for the
// blocked path (ExpandFp8PairsByTables, below) and make that path's packs of
// an FP8 weight that is not kept, call by call (PackFp8PairsByTables).
//
// StreamFp8ByTables gives SmallRows<true>'s bits exactly: every element of C
// is summed in the same order, from the same weight values, with the same
// scalar tails.
#pragma once

#include <cstdint>
#include <optional>

#include "experts/kernels/gemm.h"
#include "experts/kernels/isa.h"

namespace moefit::experts::kernels::internal {

// Whether this CPU can run the tables (AVX-512 F/BW/VL and VBMI) and they
// are not turned off.
bool Fp8TablesUsable();

// Turns the tables off (or back on) in this process: SmallRows<true> then
// decodes every byte itself. For the tests and benchmarks that compare the
// two.
void SetFp8TablesEnabled(bool enabled);

// The most rows the tables can take (those of the streamed path).
inline constexpr int64_t kFp8TableMaxRows = 8;

// The most rows the tables take, per layout of B: B k-contiguous (the
// forward GEMMs' Wᵀ) and n-contiguous (dX's W). Their advantage over the
// decoder falls as rows add multiply-adds, and where it ends depends on the
// CPU (from about 4 rows to 8 on the CPUs benchmarks/README.md lists). So
// the limits are measured once per process (MeasureFp8TableRows), unless
// held.
struct Fp8TableRowLimits {
  int64_t k_contiguous = 0, n_contiguous = 0;
};
Fp8TableRowLimits Fp8TableRows();

// Times the tables against the decoder on this core for 1..kFp8TableMaxRows
// rows of an in-cache FP8 weight (1024 x 512) in each layout, on `isa` (a
// set that multiplies bfloat16), fastest of several interleaved rounds:
// each limit is the most rows up to which the tables were the faster at
// every row count. Only where Fp8TablesUsable().
Fp8TableRowLimits MeasureFp8TableRows(Isa isa);

// Holds the limits (nullopt: back to the measured ones): for the tests that
// run the tables at every row count they can take.
void SetFp8TableRows(std::optional<Fp8TableRowLimits> limits);

// The streamed GEMM for an FP8 B, each element multiplied as bfloat16(e4m3 x
// scale), for a call that SmallRows<true> (pack_x86.h) takes. Returns false,
// having done nothing, for a B that is not FP8 and for more rows than
// Fp8TableRows(), which the decoder then takes. Only to be called where Fp8TablesUsable().
bool StreamFp8ByTables(int64_t m, int64_t n, int64_t k_size, const Operand& a, const Operand& b,
                       const Output& c, bool accumulate);

// PackedKernels::expand_fp8 of the pairs kernels (nr 32, pairs padded to a
// multiple of k_pad_pairs; ExpandFp8Pairs hands its work here where the
// tables are usable) through the same tables: 64 bytes of a compact
// pack become 64 bfloat16 by byte permutes. A table holds RoundBf16F's
// value where pack_b rounds with vcvtneps2bf16; the two differ only where
// FP8 x scale is a float32 subnormal (that instruction makes it zero), and
// the pairs kernels multiply bfloat16 subnormals as zero: the same GEMM bits.
// Only to be called where Fp8TablesUsable().
void ExpandFp8PairsByTables(int k_pad_pairs, const uint8_t* compact, const Operand& b, int64_t k0,
                            int64_t k_size, int64_t n0, int64_t n_size, void* out);

// PackBPairs' panels (pack_pairs_avx512.h: nr 32, pairs padded to a
// multiple of k_pad_pairs) of an FP8 B through the same tables, the same
// GEMM bits (as for ExpandFp8PairsByTables): the first `panels` whole
// panels of columns from n0 (a multiple of 32), their pairs from k0 up to
// the k value returned, which the caller packs on from (with the padding):
//   n-contiguous B: every whole pair (k_size rounded down to even); two
//     rows' 32 bytes interleaved by one byte permute, then looked up;
//   k-contiguous B (k0 a multiple of 64): runs of 64, each inside one scale
//     block: 16 columns' 64 bytes looked up, then two 16 x 16 transposes of
//     bfloat16 pairs.
// Returns 0, having done nothing, for other layouts. Where the pack was
// made per call by the arithmetic decoder, the blocked path at a few rows
// ran slower than streaming. Only to be called where Fp8TablesUsable().
int64_t PackFp8PairsByTables(int k_pad_pairs, const Operand& b, int64_t k0, int64_t k_size,
                             int64_t n0, int64_t panels, void* out);

}  // namespace moefit::experts::kernels::internal
