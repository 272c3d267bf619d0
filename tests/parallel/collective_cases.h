// The collective test cases every Communicator backend runs (MPI over CPU
// tensors, NCCL over CUDA tensors): one list of cases, each checked against
// values computed by hand from the ranks involved, so that both backends are
// held to the same expectations.
//
// Every rank fills its tensors with Value(src, dst, row, col), a small integer
// that says who sent the row to whom; it is exact in fp32, bf16 and int64, so
// results compare bit for bit. Row counts come from RowCount(src, dst), which
// has zero-row peers and a rank (1) that sends nothing at all. Cases check
// with EXPECT_*, so every rank stays in step through all collectives even when
// a check fails (ASSERT_* only where the outcome is the same on every rank).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "parallel/communicator.h"

namespace moefit::parallel::testing {

// The dtypes and row shapes the row-moving cases cover.
std::vector<at::ScalarType> RowDtypes();             // fp32, bf16, int64
std::vector<std::vector<int64_t>> TrailingShapes();  // [], [4], [2, 3]

// Element `col` of row `row` that rank `src` sends to rank `dst`; in [0, 256).
int64_t Value(int src, int dst, int64_t row, int64_t col);
// Rows rank `src` sends to rank `dst` in the all-to-all cases.
int64_t RowCount(int src, int dst);

void CheckAllToAllCounts(Communicator& comm, int64_t counts_per_peer);
void CheckAllToAllV(Communicator& comm, at::ScalarType dtype,
                    const std::vector<int64_t>& trailing_shape);
// The same rows picked from a source that holds each of them twice, out of
// order (AllToAllVGather), and from one where each peer's rows are one run
// of consecutive rows at an offset of its own; and a pick outside the
// source is refused.
void CheckAllToAllVGather(Communicator& comm, at::ScalarType dtype,
                          const std::vector<int64_t>& trailing_shape);
void CheckAllReduce(Communicator& comm, at::ScalarType dtype, ReduceOp op);
void CheckAllGather(Communicator& comm, at::ScalarType dtype,
                    const std::vector<int64_t>& trailing_shape);
void CheckAllGatherV(Communicator& comm, at::ScalarType dtype,
                     const std::vector<int64_t>& trailing_shape);
void CheckBroadcast(Communicator& comm, at::ScalarType dtype, int root_rank);
void CheckBarrier(Communicator& comm);
// Two collectives in flight at once, waited for in the opposite order.
void CheckOverlappingWork(Communicator& comm);
// Split by parity with reversed keys, and a rank that joins no group.
void CheckSplit(Communicator& comm);

}  // namespace moefit::parallel::testing
