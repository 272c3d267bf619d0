// The MPI backend of Communicator: collectives on CPU tensors in host memory.
//
// This is the backend of moefit's main path, where routed experts run on the
// CPUs that hold their weights and tokens travel between nodes' host memory.
// Every collective is posted as an MPI-3 non-blocking call (MPI_Ialltoallv,
// MPI_Iallreduce, ...) and returned as a Work; Wait() completes it. Open MPI
// progresses non-blocking collectives inside MPI calls, so overlap with compute
// is limited to what Wait/IsCompleted polling provides unless an MPI progress
// thread runs (parallel/mpi_progress.h); the handle lets a watchdog bound
// every wait.
//
// How tensors travel:
//   * rows (AllToAllV, AllGather(V)) as one contiguous derived datatype per
//     row, so counts and displacements are in rows: int-sized MPI arrays limit
//     a call to INT_MAX rows per peer and in total, and exceeding it fails with
//     OutOfRange instead of wrapping; AllToAllV and AllToAllVGather copy a
//     rank's rows for itself into place themselves, and AllToAllVGather
//     gathers the rows for the other ranks into one buffer, so MPI moves
//     contiguous blocks (one copy over shared memory), unless each other
//     rank's rows are already one run of the source, sent where they lie;
//   * AllReduce in the tensor's own MPI type; bf16 and fp16, which MPI has no
//     type for, are reduced in fp32 staging copies and rounded back once at the
//     end, which is also more accurate than rounding after every partial sum
//     (the price is twice the bytes on the wire);
//   * AllReduce and Broadcast split tensors longer than max_elements_per_call
//     into several calls, so gradients of any size reduce.
// Each communicator owns a duplicate of the MPI communicator it was made from,
// with MPI_ERRORS_RETURN, so every MPI code comes back to MOEFIT_CHECK_FOREIGN
// and moefit's traffic never matches messages of another library.
#pragma once

#include <mpi.h>

#include <climits>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "parallel/communicator.h"

namespace moefit::parallel {

struct MpiCommunicatorOptions {
  // The group's role in messages.
  std::string name = "world";
  // Most elements one MPI call reduces or broadcasts; longer tensors take
  // several calls. MPI counts are int, hence the default; tests lower it.
  int64_t max_elements_per_call = INT_MAX;
};

class MpiCommunicator final : public Communicator {
 public:
  // Collective over `base` (usually MPI_COMM_WORLD): duplicates it and sets
  // MPI_ERRORS_RETURN on the duplicate. MPI must be running (MpiRuntime).
  static absl::StatusOr<std::shared_ptr<MpiCommunicator>> Create(
      MPI_Comm base, const MpiCommunicatorOptions& options = {});

  // Frees the MPI communicator (skipped once MPI is finalized). Collectives
  // still pending must have been waited for; dropping their Work waits.
  ~MpiCommunicator() override;

  std::string BackendName() const override { return "MPI"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  // The MPI communicator, for code that must call MPI directly.
  MPI_Comm comm() const { return comm_; }

  std::shared_ptr<Work> AllToAllCounts(const at::Tensor& send_counts,
                                       const at::Tensor& recv_counts) override;
  std::shared_ptr<Work> AllToAllV(const at::Tensor& send, absl::Span<const int64_t> send_row_counts,
                                  const at::Tensor& recv,
                                  absl::Span<const int64_t> recv_row_counts) override;
  // The other ranks' rows gathered into one buffer, this rank's own copied
  // into place in recv.
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
  absl::StatusOr<std::shared_ptr<Communicator>> Split(int color, int key,
                                                      std::string name) override;

 private:
  // Takes ownership of `comm`, which already has MPI_ERRORS_RETURN.
  MpiCommunicator(MPI_Comm comm, int rank, int size, MpiCommunicatorOptions options,
                  std::string world_ranks);
  // "AllToAllV on communicator 'ep' (MPI, rank 1 of 4), world ranks 0-3 (4.0
  // KiB out, 2.0 KiB in)": what a Work of this communicator reports.
  std::string WorkName(absl::string_view op, int64_t send_bytes, int64_t recv_bytes) const;
  static absl::StatusOr<std::shared_ptr<MpiCommunicator>> Adopt(MPI_Comm comm,
                                                                MpiCommunicatorOptions options);
  absl::Status Free();
  // max_elements_per_call, capped at what an int count holds.
  int64_t MaxCountPerCall() const;

  MPI_Comm comm_;
  const MpiCommunicatorOptions options_;
  // Which ranks of MPI_COMM_WORLD this group holds, for messages ("0-3").
  const std::string world_ranks_;
};

}  // namespace moefit::parallel
