// The counting decorator; see counting_communicator.h.
#include "parallel/counting_communicator.h"

#include <utility>

#include "parallel/internal/collective_checks.h"

namespace moefit::parallel {
namespace {

using internal::RowBytes;

// Bytes of the rows to (or from) every rank but `self`.
int64_t ToOthers(absl::Span<const int64_t> row_counts, int self, int64_t row_bytes) {
  return (internal::Total(row_counts) - row_counts[static_cast<size_t>(self)]) * row_bytes;
}

}  // namespace

TrafficCount& TrafficCount::operator+=(const TrafficCount& o) {
  calls += o.calls;
  bytes_out += o.bytes_out;
  bytes_in += o.bytes_in;
  payload_bytes += o.payload_bytes;
  return *this;
}

TrafficCount& TrafficCount::operator-=(const TrafficCount& o) {
  calls -= o.calls;
  bytes_out -= o.bytes_out;
  bytes_in -= o.bytes_in;
  payload_bytes -= o.payload_bytes;
  return *this;
}

CountingCommunicator::CountingCommunicator(std::shared_ptr<Communicator> inner)
    : Communicator(inner->rank(), inner->size(), inner->name()), inner_(std::move(inner)) {}

std::shared_ptr<CountingCommunicator> CountingCommunicator::Create(
    std::shared_ptr<Communicator> inner) {
  return std::make_shared<CountingCommunicator>(std::move(inner));
}

std::map<std::string, TrafficCount> CountingCommunicator::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

TrafficCount CountingCommunicator::total() const {
  absl::MutexLock lock(&mu_);
  TrafficCount sum;
  for (const auto& [op, count] : counts_) sum += count;
  return sum;
}

void CountingCommunicator::Reset() {
  absl::MutexLock lock(&mu_);
  counts_.clear();
}

void CountingCommunicator::Add(const char* op, const TrafficCount& count) {
  absl::MutexLock lock(&mu_);
  counts_[op] += count;
}

std::shared_ptr<Work> CountingCommunicator::AllToAllCounts(const at::Tensor& send_counts,
                                                           const at::Tensor& recv_counts) {
  const int64_t row = RowBytes(send_counts);
  Add("AllToAllCounts", {.calls = 1,
                         .bytes_out = (size() - 1) * row,
                         .bytes_in = (size() - 1) * RowBytes(recv_counts)});
  return inner_->AllToAllCounts(send_counts, recv_counts);
}

std::shared_ptr<Work> CountingCommunicator::AllToAllV(const at::Tensor& send,
                                                      absl::Span<const int64_t> send_row_counts,
                                                      const at::Tensor& recv,
                                                      absl::Span<const int64_t> recv_row_counts) {
  Add("AllToAllV", {.calls = 1,
                    .bytes_out = ToOthers(send_row_counts, rank(), RowBytes(send)),
                    .bytes_in = ToOthers(recv_row_counts, rank(), RowBytes(recv))});
  return inner_->AllToAllV(send, send_row_counts, recv, recv_row_counts);
}

std::shared_ptr<Work> CountingCommunicator::AllToAllVGather(
    const at::Tensor& src, const at::Tensor& send_rows, absl::Span<const int64_t> send_row_counts,
    const at::Tensor& recv, absl::Span<const int64_t> recv_row_counts) {
  Add("AllToAllVGather", {.calls = 1,
                          .bytes_out = ToOthers(send_row_counts, rank(), RowBytes(src)),
                          .bytes_in = ToOthers(recv_row_counts, rank(), RowBytes(recv))});
  return inner_->AllToAllVGather(src, send_rows, send_row_counts, recv, recv_row_counts);
}

std::shared_ptr<Work> CountingCommunicator::AllReduce(const at::Tensor& tensor, ReduceOp op) {
  Add("AllReduce", {.calls = 1, .payload_bytes = static_cast<int64_t>(tensor.nbytes())});
  return inner_->AllReduce(tensor, op);
}

std::shared_ptr<Work> CountingCommunicator::AllGather(const at::Tensor& send,
                                                      const at::Tensor& recv) {
  Add("AllGather", {.calls = 1, .payload_bytes = static_cast<int64_t>(send.nbytes())});
  return inner_->AllGather(send, recv);
}

std::shared_ptr<Work> CountingCommunicator::AllGatherV(const at::Tensor& send,
                                                       const at::Tensor& recv,
                                                       absl::Span<const int64_t> recv_row_counts) {
  Add("AllGatherV", {.calls = 1, .payload_bytes = static_cast<int64_t>(send.nbytes())});
  return inner_->AllGatherV(send, recv, recv_row_counts);
}

std::shared_ptr<Work> CountingCommunicator::Broadcast(const at::Tensor& tensor, int root_rank) {
  Add("Broadcast", {.calls = 1, .payload_bytes = static_cast<int64_t>(tensor.nbytes())});
  return inner_->Broadcast(tensor, root_rank);
}

std::shared_ptr<Work> CountingCommunicator::Barrier() {
  Add("Barrier", {.calls = 1});
  return inner_->Barrier();
}

absl::StatusOr<std::shared_ptr<Communicator>> CountingCommunicator::Split(int color, int key,
                                                                          std::string name) {
  absl::StatusOr<std::shared_ptr<Communicator>> part = inner_->Split(color, key, std::move(name));
  if (!part.ok() || *part == nullptr) return part;
  return std::shared_ptr<Communicator>(Create(*std::move(part)));
}

}  // namespace moefit::parallel
