// The NCCL backend of Communicator: collectives on CUDA tensors in device
// memory, for nodes whose all-to-all runs GPU to GPU (NVLink, GPUDirect RDMA).
//
// Built only when CMake found NCCL (the copy the torch wheel ships); code that
// uses it is guarded by MOEFIT_HAS_NCCL. The communicator is bootstrapped over
// an existing CPU communicator (MPI): rank 0 creates the NCCL unique id and
// broadcasts it, so launch stays plain mpirun, and Split splits the bootstrap
// group first and builds a new NCCL communicator over each part.
//
// Stream semantics follow LibTorch: every collective is enqueued on the current
// CUDA stream of the communicator's device (c10::cuda::getCurrentCUDAStream),
// so later work on that stream sees its result without any host wait, and the
// tensors' memory is safe under the caching allocator as long as they were
// made on that stream. Work::Wait() blocks the host until the GPU has finished
// the collective, polling so that an asynchronous NCCL error (a peer gone) is
// reported instead of hanging; a finite timeout bounds it for a watchdog.
//
// Wire formats: rows and broadcasts travel as bytes (ncclUint8), so every
// dtype works and counts are size_t; reductions use NCCL's own types,
// including ncclBfloat16 and ncclFloat16. The row all-to-all is a group of
// ncclSend/ncclRecv, one pair per peer with a non-zero count, and a device copy
// for the rows a rank keeps.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"

// nccl.h: typedef struct ncclComm* ncclComm_t. Forward-declared so that this
// header needs neither NCCL's nor CUDA's include paths.
struct ncclComm;

namespace moefit::parallel {

struct NcclCommunicatorOptions {
  // The group's role in messages.
  std::string name = "world";
  // CUDA device of this rank; -1: LibTorch's current device. One rank per
  // device: NCCL refuses two ranks of a communicator on one GPU.
  int device_idx = -1;
};

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `bootstrap` (a CPU communicator, e.g. MPI): the new
  // communicator has the same ranks. Fails with FailedPrecondition when no CUDA
  // device is visible. Waits for the other ranks at most the collective
  // deadline (parallel/watchdog.h); then the watchdog ends the job.
  static absl::StatusOr<std::shared_ptr<NcclCommunicator>> Create(
      std::shared_ptr<Communicator> bootstrap, const NcclCommunicatorOptions& options = {});

  // The NCCL communicator itself goes with the last of this object and its Work
  // handles: ncclCommDestroy, or ncclCommAbort while an exception is unwinding
  // (peers may never join what is pending).
  ~NcclCommunicator() override;

  std::string BackendName() const override { return "NCCL"; }
  c10::Device device() const override;
  // NCCL calls only enqueue work on a stream; any one thread at a time may.
  bool PostsFromAnyThread() const override { return true; }

  std::shared_ptr<Work> AllToAllCounts(const at::Tensor& send_counts,
                                       const at::Tensor& recv_counts) override;
  std::shared_ptr<Work> AllToAllV(const at::Tensor& send, absl::Span<const int64_t> send_row_counts,
                                  const at::Tensor& recv,
                                  absl::Span<const int64_t> recv_row_counts) override;
  // Sends each peer's rows where they lie when they are one block of `src`
  // (internal::RowRunStarts), else gathers them first.
  std::shared_ptr<Work> AllToAllVGather(const at::Tensor& src, const at::Tensor& send_rows,
                                        absl::Span<const int64_t> send_row_counts,
                                        const at::Tensor& recv,
                                        absl::Span<const int64_t> recv_row_counts) override;
  std::shared_ptr<Work> AllReduce(const at::Tensor& tensor, ReduceOp op) override;
  std::shared_ptr<Work> AllGather(const at::Tensor& send, const at::Tensor& recv) override;
  std::shared_ptr<Work> AllGatherV(const at::Tensor& send, const at::Tensor& recv,
                                   absl::Span<const int64_t> recv_row_counts) override;
  std::shared_ptr<Work> Broadcast(const at::Tensor& tensor, int root_rank) override;
  // An all-reduce of one element: completes (on Wait) once every rank has
  // reached it on the GPU.
  std::shared_ptr<Work> Barrier() override;
  absl::StatusOr<std::shared_ptr<Communicator>> Split(int color, int key,
                                                      std::string name) override;

 private:
  NcclCommunicator(std::shared_ptr<ncclComm> comm, std::shared_ptr<Communicator> bootstrap,
                   int device_idx, std::string name);

  // Shared with every Work so that a Work can still ask NCCL for asynchronous
  // errors after the communicator object is gone.
  const std::shared_ptr<ncclComm> comm_;
  const std::shared_ptr<Communicator> bootstrap_;
  const int device_idx_;
};

}  // namespace moefit::parallel
