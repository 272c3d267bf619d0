// Argument checks shared by every Communicator backend (see the header).
#include "parallel/internal/collective_checks.h"

#include <c10/util/Exception.h>

namespace moefit::parallel::internal {
namespace {

// Defined tensor, contiguous, on the backend's device.
void CheckBuffer(const Communicator& comm, std::string_view op, std::string_view role,
                 const at::Tensor& tensor) {
  TORCH_CHECK(tensor.defined(), op, " on ", comm.name(), ": ", role, " is an undefined tensor");
  TORCH_CHECK(tensor.is_contiguous(), op, " on ", comm.name(), ": ", role,
              " must be contiguous, got strides ", tensor.strides());
  TORCH_CHECK(tensor.device() == comm.device(), op, " on ", comm.name(), ": ", role, " is on ",
              tensor.device(), " but the ", comm.BackendName(), " backend needs tensors on ",
              comm.device());
}

// Both have rows of the same dtype and trailing shape.
void CheckSameRows(const Communicator& comm, std::string_view op, const at::Tensor& send,
                   const at::Tensor& recv) {
  TORCH_CHECK(send.dim() >= 1 && recv.dim() >= 1, op, " on ", comm.name(),
              ": send and recv need a row dimension (dim 0), got shapes ", send.sizes(), " and ",
              recv.sizes());
  TORCH_CHECK(send.scalar_type() == recv.scalar_type(), op, " on ", comm.name(), ": send is ",
              send.scalar_type(), " but recv is ", recv.scalar_type());
  TORCH_CHECK(send.sizes().slice(1) == recv.sizes().slice(1), op, " on ", comm.name(),
              ": rows of send and recv differ in shape: ", send.sizes(), " vs ", recv.sizes());
}

void CheckCounts(const Communicator& comm, std::string_view op, std::string_view role,
                 absl::Span<const int64_t> counts, int64_t rows) {
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == comm.size(), op, " on ", comm.name(), ": ",
              role, " has ", counts.size(), " entries, one per rank expected (", comm.size(), ")");
  for (size_t peer_idx = 0; peer_idx < counts.size(); ++peer_idx) {
    TORCH_CHECK(counts[peer_idx] >= 0, op, " on ", comm.name(), ": ", role, "[", peer_idx,
                "] is negative: ", counts[peer_idx]);
  }
  TORCH_CHECK(Total(counts) == rows, op, " on ", comm.name(), ": ", role, " add up to ",
              Total(counts), " rows but the tensor has ", rows);
}

// What a rank sends itself is what it expects from itself.
void CheckSelfRows(const Communicator& comm, std::string_view op,
                   absl::Span<const int64_t> send_row_counts,
                   absl::Span<const int64_t> recv_row_counts) {
  TORCH_CHECK(send_row_counts[comm.rank()] == recv_row_counts[comm.rank()], op, " on ", comm.name(),
              ": this rank sends itself ", send_row_counts[comm.rank()], " rows but expects ",
              recv_row_counts[comm.rank()], " from itself");
}

}  // namespace

int64_t RowBytes(const at::Tensor& tensor) {
  int64_t num_row_elements = 1;
  for (int64_t dim_idx = 1; dim_idx < tensor.dim(); ++dim_idx)
    num_row_elements *= tensor.size(dim_idx);
  return num_row_elements * static_cast<int64_t>(tensor.element_size());
}

int64_t Total(absl::Span<const int64_t> counts) {
  int64_t total = 0;
  for (const int64_t count : counts) total += count;
  return total;
}

int64_t BlockStart(absl::Span<const int64_t> counts, int rank) {
  return Total(counts.first(static_cast<size_t>(rank)));
}

std::vector<int64_t> RowRunStarts(const at::Tensor& send_rows, absl::Span<const int64_t> counts,
                                  int skip) {
  std::vector<int64_t> starts(counts.size(), 0);
  const at::Tensor rows = send_rows.contiguous();
  const int64_t* r = rows.data_ptr<int64_t>();
  int64_t begin = 0;
  for (size_t p = 0; p < counts.size(); begin += counts[p], ++p) {
    if (static_cast<int>(p) == skip || counts[p] == 0) continue;
    starts[p] = r[begin];
    for (int64_t i = 1; i < counts[p]; ++i) {
      if (r[begin + i] != r[begin] + i) return {};
    }
  }
  return starts;
}

void CheckAllToAllCounts(const Communicator& comm, const at::Tensor& send_counts,
                         const at::Tensor& recv_counts) {
  constexpr std::string_view kOp = "AllToAllCounts";
  CheckBuffer(comm, kOp, "send_counts", send_counts);
  CheckBuffer(comm, kOp, "recv_counts", recv_counts);
  CheckSameRows(comm, kOp, send_counts, recv_counts);
  TORCH_CHECK(send_counts.scalar_type() == at::kLong, kOp, " on ", comm.name(),
              ": counts must be int64, got ", send_counts.scalar_type());
  TORCH_CHECK(send_counts.size(0) == comm.size() && recv_counts.size(0) == comm.size(), kOp, " on ",
              comm.name(), ": counts need one row per rank (", comm.size(), "), got ",
              send_counts.sizes(), " and ", recv_counts.sizes());
}

void CheckAllToAllV(const Communicator& comm, const at::Tensor& send,
                    absl::Span<const int64_t> send_row_counts, const at::Tensor& recv,
                    absl::Span<const int64_t> recv_row_counts) {
  constexpr std::string_view kOp = "AllToAllV";
  CheckBuffer(comm, kOp, "send", send);
  CheckBuffer(comm, kOp, "recv", recv);
  CheckSameRows(comm, kOp, send, recv);
  CheckCounts(comm, kOp, "send_row_counts", send_row_counts, send.size(0));
  CheckCounts(comm, kOp, "recv_row_counts", recv_row_counts, recv.size(0));
  CheckSelfRows(comm, kOp, send_row_counts, recv_row_counts);
}

void CheckAllToAllVGather(const Communicator& comm, const at::Tensor& src,
                          const at::Tensor& send_rows, absl::Span<const int64_t> send_row_counts,
                          const at::Tensor& recv, absl::Span<const int64_t> recv_row_counts) {
  constexpr std::string_view kOp = "AllToAllVGather";
  CheckBuffer(comm, kOp, "src", src);
  CheckBuffer(comm, kOp, "recv", recv);
  CheckSameRows(comm, kOp, src, recv);
  TORCH_CHECK(send_rows.dim() == 1 && send_rows.scalar_type() == at::kLong && send_rows.is_cpu() &&
                  send_rows.is_contiguous(),
              kOp, " on ", comm.name(),
              ": send_rows must be a contiguous 1-d int64 host tensor, got ",
              send_rows.scalar_type(), " ", send_rows.sizes(), " on ", send_rows.device());
  CheckCounts(comm, kOp, "send_row_counts", send_row_counts, send_rows.size(0));
  CheckCounts(comm, kOp, "recv_row_counts", recv_row_counts, recv.size(0));
  CheckSelfRows(comm, kOp, send_row_counts, recv_row_counts);
  const int64_t* rows = send_rows.data_ptr<int64_t>();
  const auto [lo, hi] = std::minmax_element(rows, rows + send_rows.numel());
  TORCH_CHECK(send_rows.numel() == 0 || (*lo >= 0 && *hi < src.size(0)), kOp, " on ", comm.name(),
              ": send_rows picks rows outside src's ", src.size(0), " (from ",
              send_rows.numel() == 0 ? 0 : *lo, " to ", send_rows.numel() == 0 ? 0 : *hi, ")");
}

void CheckAllReduce(const Communicator& comm, const at::Tensor& tensor) {
  CheckBuffer(comm, "AllReduce", "tensor", tensor);
  TORCH_CHECK(!tensor.is_complex() && tensor.scalar_type() != at::kBool, "AllReduce on ",
              comm.name(), ": cannot reduce ", tensor.scalar_type());
}

void CheckAllGather(const Communicator& comm, const at::Tensor& send, const at::Tensor& recv) {
  constexpr std::string_view kOp = "AllGather";
  CheckBuffer(comm, kOp, "send", send);
  CheckBuffer(comm, kOp, "recv", recv);
  CheckSameRows(comm, kOp, send, recv);
  TORCH_CHECK(recv.size(0) == send.size(0) * comm.size(), kOp, " on ", comm.name(), ": recv needs ",
              comm.size(), " x ", send.size(0), " rows, got ", recv.size(0));
}

void CheckAllGatherV(const Communicator& comm, const at::Tensor& send, const at::Tensor& recv,
                     absl::Span<const int64_t> recv_row_counts) {
  constexpr std::string_view kOp = "AllGatherV";
  CheckBuffer(comm, kOp, "send", send);
  CheckBuffer(comm, kOp, "recv", recv);
  CheckSameRows(comm, kOp, send, recv);
  CheckCounts(comm, kOp, "recv_row_counts", recv_row_counts, recv.size(0));
  TORCH_CHECK(send.size(0) == recv_row_counts[comm.rank()], kOp, " on ", comm.name(),
              ": this rank sends ", send.size(0), " rows but recv_row_counts[", comm.rank(),
              "] is ", recv_row_counts[comm.rank()]);
}

void CheckBroadcast(const Communicator& comm, const at::Tensor& tensor, int root_rank) {
  CheckBuffer(comm, "Broadcast", "tensor", tensor);
  TORCH_CHECK(root_rank >= 0 && root_rank < comm.size(), "Broadcast on ", comm.name(),
              ": root rank ", root_rank, " is outside [0, ", comm.size(), ")");
}

}  // namespace moefit::parallel::internal
