// Argument checks shared by every Communicator backend.
//
// A misuse (a CUDA tensor given to MPI, count lists of the wrong length, counts
// that do not add up to the rows) is a bug on the calling rank; it throws
// c10::Error (TORCH_CHECK) before anything is posted, with the same message
// whichever backend runs. Cross-rank agreement (what rank p sends equals what
// rank q expects) cannot be checked locally; the transport reports it, or the
// counts exchange (AllToAllCounts) guarantees it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/types/span.h"
#include "parallel/communicator.h"

namespace moefit::parallel::internal {

// Bytes in one row (slice along dim 0) of `tensor`, which has dim() >= 1;
// well defined when the tensor has no rows.
int64_t RowBytes(const at::Tensor& tensor);

// Sum of `counts`.
int64_t Total(absl::Span<const int64_t> counts);

// Where rank `rank`'s block starts among rows laid out by `counts` (the sum
// of the counts before it).
int64_t BlockStart(absl::Span<const int64_t> counts, int rank);

// For AllToAllVGather's `send_rows` ([sum(counts)] int64 on the host) in
// blocks of counts[p] per peer p: the row of src each block starts at, when
// every block (but rank `skip`'s, if any) is one ascending run of
// consecutive rows, so that it can be sent where it lies; empty otherwise.
std::vector<int64_t> RowRunStarts(const at::Tensor& send_rows, absl::Span<const int64_t> counts,
                                  int skip = -1);

void CheckAllToAllCounts(const Communicator& comm, const at::Tensor& send_counts,
                         const at::Tensor& recv_counts);
void CheckAllToAllV(const Communicator& comm, const at::Tensor& send,
                    absl::Span<const int64_t> send_row_counts, const at::Tensor& recv,
                    absl::Span<const int64_t> recv_row_counts);
// AllToAllVGather: the AllToAllV checks with `src` as the rows' source, and
// send_rows [sum(send_row_counts)] int64 on the host within src's rows.
void CheckAllToAllVGather(const Communicator& comm, const at::Tensor& src,
                          const at::Tensor& send_rows, absl::Span<const int64_t> send_row_counts,
                          const at::Tensor& recv, absl::Span<const int64_t> recv_row_counts);
void CheckAllReduce(const Communicator& comm, const at::Tensor& tensor);
void CheckAllGather(const Communicator& comm, const at::Tensor& send, const at::Tensor& recv);
void CheckAllGatherV(const Communicator& comm, const at::Tensor& send, const at::Tensor& recv,
                     absl::Span<const int64_t> recv_row_counts);
void CheckBroadcast(const Communicator& comm, const at::Tensor& tensor, int root_rank);

}  // namespace moefit::parallel::internal
