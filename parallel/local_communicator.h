// A communicator of one rank, without MPI: every collective is a local copy.
//
// It lets a single process run the very code path of an expert-parallel job
// (dispatch, combine, gradient sync) with no MPI runtime — the single-process
// `moefit train`, unit tests, and the one-rank baseline that multi-rank tests
// compare against.
#pragma once

#include <memory>
#include <string>

#include "parallel/communicator.h"

namespace moefit::parallel {

class LocalCommunicator final : public Communicator {
 public:
  explicit LocalCommunicator(std::string name = "world") : Communicator(0, 1, std::move(name)) {}
  static std::shared_ptr<LocalCommunicator> Create(std::string name = "world") {
    return std::make_shared<LocalCommunicator>(std::move(name));
  }

  std::string BackendName() const override { return "local"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }

  std::shared_ptr<Work> AllToAllCounts(const at::Tensor& send_counts,
                                       const at::Tensor& recv_counts) override;
  std::shared_ptr<Work> AllToAllV(const at::Tensor& send, absl::Span<const int64_t> send_row_counts,
                                  const at::Tensor& recv,
                                  absl::Span<const int64_t> recv_row_counts) override;
  std::shared_ptr<Work> AllReduce(const at::Tensor& tensor, ReduceOp op) override;
  std::shared_ptr<Work> AllGather(const at::Tensor& send, const at::Tensor& recv) override;
  std::shared_ptr<Work> AllGatherV(const at::Tensor& send, const at::Tensor& recv,
                                   absl::Span<const int64_t> recv_row_counts) override;
  std::shared_ptr<Work> Broadcast(const at::Tensor& tensor, int root_rank) override;
  std::shared_ptr<Work> Barrier() override;
  absl::StatusOr<std::shared_ptr<Communicator>> Split(int color, int key, std::string name) override;
};

}  // namespace moefit::parallel
