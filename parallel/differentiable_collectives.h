// Collectives as autograd functions: the backward of each is the collective
// that sends gradients back along the opposite route.
//
//   SendRows:         each member row of a row relation (experts/kernels/row_ops.h) to its
//                     rank, read where it lies in x; backward = ReturnRows
//                     of the gradients along the opposite route.
//   ReturnRows:       rows back from the ranks, each group of the relation
//                     summing its members; backward = SendRows of the
//                     gradients along the opposite route.
//   AllGatherRows:    every rank gets all ranks' rows; backward = sum the
//                     gradient over ranks (all-reduce) and keep this rank's rows.
//   SumKeepOwnRows:   element-wise sum over ranks, keep this rank's rows;
//                     backward = all-gather of the rows' gradients.
//
// Blocking: each waits for its collective (forward and backward) and throws
// c10::Error if it failed; the caller's only safe reaction is AbortAll.
//
// SendRows and ReturnRows also come split in two, for pipelining: Start*
// posts the collective and returns at once, FinishRows waits for it. Each half
// is an autograd node, linked by an empty tensor, and in backward the roles
// swap: Finish's backward posts the gradients' collective and Start's backward
// waits for it. Autograd runs the nodes of a graph in the reverse order of
// their creation (the CPU ready queue takes the highest sequence number first,
// and the latest-created node still to run is always ready), so a forward that
// posts chunk c + 1's move before computing chunk c gets a backward that does
// the same, mirrored.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <vector>

#include "experts/kernels/row_ops.h"
#include "parallel/communicator.h"

namespace moefit::parallel {

// x: [groups, ...] -> [sum(recv_counts), ...]: member m of `relation` (sent
// in member order, send_counts[p] of them to rank p) is x's row slot[m] / f,
// gathered as it is sent (Communicator::AllToAllVGather), in x's dtype.
at::Tensor SendRows(Communicator& comm, const at::Tensor& x,
                    const experts::kernels::RowRelation& relation,
                    const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& recv_counts);

// x: [sum(send_counts), ...] -> [groups, ...]: the rows come back as the
// relation's members (recv_counts[p] from rank p) and each group gets the sum
// of its members (experts::kernels::Collect, in x's dtype promoted to at least
// float32). The rows this rank sends itself are not moved: the sums read
// them in x (experts::kernels::SumAroundBlock).
at::Tensor ReturnRows(Communicator& comm, const at::Tensor& x,
                      const experts::kernels::RowRelation& relation,
                      const std::vector<int64_t>& send_counts,
                      const std::vector<int64_t>& recv_counts);

// A row move posted by StartSendRows or StartReturnRows.
struct RowsInFlight {
  // [0] in the moved tensor's dtype: the autograd link from Start's node to
  // Finish's (requires grad when the moved tensor does).
  at::Tensor link;
  // The collective and what its two halves share (opaque outside the .cc).
  c10::intrusive_ptr<torch::CustomClassHolder> move;
};

// SendRows and ReturnRows with the same arguments and results, split: the
// collective is posted by Start and waited for by FinishRows, which must be
// called exactly once per Start, in the same order on every rank of `comm`
// relative to its other collectives. `x` stays referenced until the move has
// finished.
RowsInFlight StartSendRows(Communicator& comm, const at::Tensor& x,
                           const experts::kernels::RowRelation& relation,
                           const std::vector<int64_t>& send_counts,
                           const std::vector<int64_t>& recv_counts);
RowsInFlight StartReturnRows(Communicator& comm, const at::Tensor& x,
                             const experts::kernels::RowRelation& relation,
                             const std::vector<int64_t>& send_counts,
                             const std::vector<int64_t>& recv_counts);
at::Tensor FinishRows(const RowsInFlight& rows);

// x: [row_counts[rank], ...] -> [sum(row_counts), ...] in rank order.
at::Tensor AllGatherRows(Communicator& comm, const at::Tensor& x,
                         const std::vector<int64_t>& row_counts);

// x: [sum(row_counts), ...], a partial sum on every rank -> this rank's rows
// [row_counts[rank], ...] of the sum over ranks.
at::Tensor SumKeepOwnRows(Communicator& comm, const at::Tensor& x,
                          const std::vector<int64_t>& row_counts);

}  // namespace moefit::parallel
