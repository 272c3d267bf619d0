// Collectives as autograd functions: the backward of each is the collective
// that sends gradients back along the opposite route.
//
//   AllToAllRows:     rows to peers by counts; backward = the reverse all-to-all.
//   AllGatherRows:    every rank gets all ranks' rows; backward = sum the
//                     gradient over ranks (all-reduce) and keep this rank's rows.
//   SumKeepOwnRows:   element-wise sum over ranks, keep this rank's rows;
//                     backward = all-gather of the rows' gradients.
//
// Blocking: each waits for its collective (forward and backward) and throws
// c10::Error if it failed; the caller's only safe reaction is AbortAll.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "parallel/communicator.h"

namespace moefit::parallel {

// x: [sum(send_counts), ...] -> [sum(recv_counts), ...].
at::Tensor AllToAllRows(Communicator& comm, const at::Tensor& x,
                        const std::vector<int64_t>& send_counts,
                        const std::vector<int64_t>& recv_counts);

// x: [row_counts[rank], ...] -> [sum(row_counts), ...] in rank order.
at::Tensor AllGatherRows(Communicator& comm, const at::Tensor& x,
                         const std::vector<int64_t>& row_counts);

// x: [sum(row_counts), ...], a partial sum on every rank -> this rank's rows
// [row_counts[rank], ...] of the sum over ranks.
at::Tensor SumKeepOwnRows(Communicator& comm, const at::Tensor& x,
                          const std::vector<int64_t>& row_counts);

}  // namespace moefit::parallel
