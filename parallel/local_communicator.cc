// The one-rank communicator; see local_communicator.h.
#include "parallel/local_communicator.h"

#include <ATen/ATen.h>

namespace moefit::parallel {
namespace {

std::shared_ptr<Work> Copy(const at::Tensor& from, const at::Tensor& to) {
  TORCH_CHECK(from.numel() == to.numel() && from.scalar_type() == to.scalar_type(),
              "local collective: ", from.sizes(), " ", from.scalar_type(), " into ", to.sizes(),
              " ", to.scalar_type());
  if (from.numel() > 0) to.view(from.sizes()).copy_(from);
  return Work::Completed(absl::OkStatus());
}

}  // namespace

std::shared_ptr<Work> LocalCommunicator::AllToAllCounts(const at::Tensor& send,
                                                        const at::Tensor& recv) {
  return Copy(send, recv);
}

std::shared_ptr<Work> LocalCommunicator::AllToAllV(const at::Tensor& send,
                                                   absl::Span<const int64_t> send_rows,
                                                   const at::Tensor& recv,
                                                   absl::Span<const int64_t> recv_rows) {
  TORCH_CHECK(send_rows.size() == 1 && recv_rows.size() == 1 && send_rows[0] == recv_rows[0],
              "local all-to-all: counts of one peer must match");
  return Copy(send, recv);
}

std::shared_ptr<Work> LocalCommunicator::AllReduce(const at::Tensor&, ReduceOp) {
  return Work::Completed(absl::OkStatus());
}

std::shared_ptr<Work> LocalCommunicator::AllGather(const at::Tensor& send, const at::Tensor& recv) {
  return Copy(send, recv);
}

std::shared_ptr<Work> LocalCommunicator::AllGatherV(const at::Tensor& send, const at::Tensor& recv,
                                                    absl::Span<const int64_t> rows) {
  TORCH_CHECK(rows.size() == 1, "local all-gather: one rank");
  return Copy(send, recv);
}

std::shared_ptr<Work> LocalCommunicator::Broadcast(const at::Tensor&, int root_rank) {
  TORCH_CHECK(root_rank == 0, "local broadcast from rank ", root_rank);
  return Work::Completed(absl::OkStatus());
}

std::shared_ptr<Work> LocalCommunicator::Barrier() { return Work::Completed(absl::OkStatus()); }

absl::StatusOr<std::shared_ptr<Communicator>> LocalCommunicator::Split(int color, int,
                                                                       std::string name) {
  if (color < 0) return std::shared_ptr<Communicator>();
  return std::shared_ptr<Communicator>(
      std::make_shared<LocalCommunicator>(name.empty() ? this->name() + "/0" : std::move(name)));
}

}  // namespace moefit::parallel
