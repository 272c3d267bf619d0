// Row moves of the dispatchers and the expert layer, over a one-to-many
// relation between the rows of two tensors, parallel over rows and
// autograd-aware. They know no ranks: the dispatchers (parallel/) move rows
// with them around their all-to-alls, and the expert layer sums the
// gradients of a row its experts read several times (expert_function.h).
//
// A RowRelation links P "group" rows to M "member" rows: group p has up to f
// members, `members[p, j]` (-1 for none), and each member belongs to exactly
// one group, at flat position `slot[m] = p * f + j`. The dispatchers use two:
//   home    tokens (groups, f = ranks) and the rows they send (members, one
//           per rank that owns one of the token's experts);
//   remote  received rows (groups, f = top-k) and their computation rows, one
//           per local expert they visit (the experts read the received row
//           by index, GroupOf).
// Collect sums each group's members; its backward hands each member its
// group's gradient row.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace moefit::experts::kernels {

struct RowRelation {
  at::Tensor members;  // [P, f] int64, -1 where group p has fewer than f
  at::Tensor slot;     // [M] int64: p * f + j of each member
};

// Builds `slot` from `members` (whose non-negative entries must be exactly
// 0..num_members-1, each once). Throws c10::Error otherwise.
RowRelation MakeRowRelation(at::Tensor members, int64_t num_members);

// [M] int64: the group of each member, slot[m] / f: the row of a [P, H]
// tensor that member m stands for.
at::Tensor GroupOf(const RowRelation& relation);

// [P, H]: group p gets sum_j weight[p, j] * src[members[p, j]] (src: [M, H];
// weight [P, f] or undefined for 1), summed in j order, in src's dtype
// promoted to at least float32. Differentiable in src and weight.
at::Tensor Collect(const at::Tensor& src, const RowRelation& relation,
                   const at::Tensor& weight = {});

// Collect without weights and without autograd of the rows of `src` with
// `block` inserted before src's row `block_at`: member m is block's row
// m - block_at where it falls in the block, else src's row m (before it) or
// m - block.size(0) (after it). The same sums in the same order as Collect
// of the rows put together, without putting them together.
at::Tensor SumAroundBlock(const at::Tensor& src, int64_t block_at, const at::Tensor& block,
                          const RowRelation& relation);

// Bytes of the largest cache the first core sees, as the kernel reports it in
// sysfs, else as the C library's sysconf says (which said 320 MiB on a
// virtual machine whose L3 is 32 MiB); 32 MiB where neither does.
int64_t LastLevelCacheBytes();

// Collect's backward writes float32 gradient rows with non-temporal stores
// (past the cache) when they take more than `bytes` in all; the default is
// the last-level cache's size. For tests, which set 0 to run that path;
// returns the value it replaces.
int64_t SetStreamAboveBytes(int64_t bytes);

}  // namespace moefit::experts::kernels
