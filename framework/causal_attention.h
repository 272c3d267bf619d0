// Causal self-attention on the CPU in float32, forward and backward, that
// computes only the blocks of scores at or below the diagonal.
//
// Why not SDPA's CPU flash kernel: its key blocks are 512 wide, so for causal
// sequences of up to 512 tokens it computes every score and masks half of
// them away (beyond, the part of each block above the diagonal), forward and
// backward (the backward recomputes the scores and three more products of the
// same size). Here queries go in blocks of kQueryBlock rows, each against the
// keys up to its last row only: 9/16 of the products at T = 256, approaching
// half as T grows. The GEMMs are moefit's own (experts/kernels/gemm.h, strided operands:
// q, k, v are read where they lie, transposed or not), the exponentials the
// same kernels' vector exp.
//
// Packed sequences: with segment starts, query t attends to the keys from its
// segment's first position to t only, and blocks wholly before a query
// block's segments are skipped too.
//
// Grouped-query attention is native: k and v carry the key-value heads, query
// head h reads head h / (heads / kv_heads), with no repeated copy; the key and
// value gradients are summed over each group's query heads in a fixed order.
//
// Numerics: float32 throughout; the softmax is online over key blocks
// (running maximum and sum, as flash attention), its logsumexp kept for the
// backward, which recomputes the probabilities from it. Results differ from
// SDPA's by float32 rounding (summation order and the vector exp, a few units
// in the last place), and do not depend on the number of threads: each output
// row, and each head's key and value gradients, is summed by one thread in a
// fixed order.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace moefit::framework {

// Queries per block: the unit of the causal skip.
inline constexpr int64_t kQueryBlock = 32;

// Whether CausalAttention takes these inputs: float32 CPU tensors q [B, H, T,
// dk], k [B, Hkv, T, dk], v [B, Hkv, T, dv] with H a multiple of Hkv and the
// same T (self-attention); any strides.
bool CausalAttentionApplies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// segment_ids [B, T] (0, 1, ... for the consecutive segments of each row, as
// packed batches carry them) -> [B, T] int64: the position of the first token
// of each token's segment.
at::Tensor SegmentStarts(const at::Tensor& segment_ids);

// softmax(q k^T * scale + causal mask) v -> [B, H, T, dv], each query row t
// attending to the keys at or before it, and with `segment_starts`
// (SegmentStarts, on the CPU) at or after segment_starts[b, t] as well;
// autograd-aware (q, k, v). The result is laid out [B, T, H, dv] in memory (a
// transposed view), as the output projection reads it.
at::Tensor CausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           double scale, const at::Tensor& segment_starts = {});

}  // namespace moefit::framework
