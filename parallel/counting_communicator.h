// A Communicator that hands every collective to another one and counts the
// bytes this rank's all-to-alls send to and receive from the other ranks of the
// group: what crosses between processes (and, across nodes, the network).
//
// Counted, not timed: the bytes of an all-to-all to each peer follow from its
// row counts, so a change in what is sent (deduplicated dispatch, a narrower
// dtype) shows as an exact number that no noise hides, on any backend (the
// count is taken above the communicator, MPI or NCCL alike). The rows a rank
// sends itself never leave the process and are not counted.
//
// All-reduce, all-gather(-v) and broadcast are recorded too, as calls and the
// bytes handed to them (`payload_bytes`): what they put on the wire depends on
// the backend's algorithm, so they are kept apart from the exact counts.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "parallel/communicator.h"

namespace moefit::parallel {

struct TrafficCount {
  int64_t calls = 0;
  // All-to-alls: bytes sent to and received from the other ranks.
  int64_t bytes_out = 0;
  int64_t bytes_in = 0;
  // Other collectives: the bytes of the tensors handed to them.
  int64_t payload_bytes = 0;

  TrafficCount& operator+=(const TrafficCount& o);
  TrafficCount& operator-=(const TrafficCount& o);
};

class CountingCommunicator final : public Communicator {
 public:
  // Same rank, size and name as `inner`, whose collectives it runs.
  explicit CountingCommunicator(std::shared_ptr<Communicator> inner);
  static std::shared_ptr<CountingCommunicator> Create(std::shared_ptr<Communicator> inner);

  // Counts so far, by operation ("AllToAllV", "AllReduce", ...), and their sum.
  std::map<std::string, TrafficCount> counts() const;
  TrafficCount total() const;
  void Reset();

  std::string BackendName() const override { return inner_->BackendName(); }
  c10::Device device() const override { return inner_->device(); }
  bool PostsFromAnyThread() const override { return inner_->PostsFromAnyThread(); }

  std::shared_ptr<Work> AllToAllCounts(const at::Tensor& send_counts,
                                       const at::Tensor& recv_counts) override;
  std::shared_ptr<Work> AllToAllV(const at::Tensor& send, absl::Span<const int64_t> send_row_counts,
                                  const at::Tensor& recv,
                                  absl::Span<const int64_t> recv_row_counts) override;
  std::shared_ptr<Work> AllToAllVGather(const at::Tensor& src, const at::Tensor& send_rows,
                                        absl::Span<const int64_t> send_row_counts,
                                        const at::Tensor& recv,
                                        absl::Span<const int64_t> recv_row_counts) override;
  std::shared_ptr<Work> AllReduce(const at::Tensor& tensor, ReduceOp op) override;
  std::shared_ptr<Work> AllGather(const at::Tensor& send, const at::Tensor& recv) override;
  std::shared_ptr<Work> AllGatherV(const at::Tensor& send, const at::Tensor& recv,
                                   absl::Span<const int64_t> recv_row_counts) override;
  std::shared_ptr<Work> Broadcast(const at::Tensor& tensor, int root_rank) override;
  std::shared_ptr<Work> Barrier() override;
  // The part of `inner`'s split this rank joins, counted on its own.
  absl::StatusOr<std::shared_ptr<Communicator>> Split(int color, int key,
                                                      std::string name) override;

 private:
  void Add(const char* op, const TrafficCount& count);

  const std::shared_ptr<Communicator> inner_;
  mutable absl::Mutex mu_;
  std::map<std::string, TrafficCount> counts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moefit::parallel
