// The collectives that expert parallelism needs, behind one interface with an
// MPI backend (host memory) and an NCCL backend (device memory).
//
// Shaped after PyTorch c10d's Backend/Work pair: one virtual per collective,
// whose default body fails and names the backend, so a backend that lacks an
// operation says so instead of crashing; each call returns a Work handle, so a
// collective can overlap with compute and a watchdog can wait on it with a
// deadline. The operations are the ones a Mixture-of-Experts step uses: the
// counts exchange and the row all-to-all of token dispatch and combine, all-
// reduce for gradients and flags, all-gather(-v) for statistics, broadcast for
// initial weights and ids, and Split to carve the expert-parallel and data-
// parallel groups out of the world (parallel/process_groups.h).
//
// Tensors are always contiguous and live where the backend wants them
// (device(): CPU for MPI, the communicator's GPU for NCCL). "Rows" are slices
// along dim 0; the row all-to-all moves rows of any trailing shape and dtype
// as raw bytes, so bf16 activations, fp32 gradients and int64 ids go through
// the same call.
//
// Errors come in two kinds:
//   * a misuse on this rank (wrong device, dtype, count list length, counts that
//     do not add up to the rows) throws c10::Error from the call itself, before
//     anything is posted;
//   * a failure of the transport comes back as the absl::Status of Work::Wait().
// Either way the peers may now be blocked in the collective: the only safe
// reaction to an error is to end the job with AbortAll (parallel/mpi_runtime.h),
// which every moefit entry point does.
//
// Threading: a communicator and its Work handles are used from one thread, the
// one that started MPI (MPI_THREAD_FUNNELED); the watchdog's thread only reads
// progress and, when a deadline has long passed, aborts. Every rank of a communicator must
// issue the same collectives in the same order.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace moefit::parallel {

enum class ReduceOp { kSum, kMax, kMin };

// Wall-clock seconds this process has spent blocked in Work::Wait since it
// started: the "communication" of a step's time split (it includes waiting
// for slower peers, i.e. load imbalance).
double CommunicationWaitSeconds();

const char* ReduceOpName(ReduceOp op);

// A posted collective. Buffers handed to the collective must not be read or
// written (and are kept alive by the handle) until it has completed. For MPI,
// "completed" means the data is in host memory; for NCCL, that the GPU has run
// it (work later enqueued on the same stream sees the result without waiting).
// Dropping an unfinished handle waits for it (MPI) or leaves it to stream
// order (NCCL); while an exception is unwinding it waits for nothing, since a
// peer may never arrive and the job is about to be aborted.
class Work {
 public:
  virtual ~Work() = default;

  // Non-blocking: true once the collective has finished (successfully or not);
  // Wait() then returns at once.
  virtual bool IsCompleted() = 0;

  // Blocks the calling thread until the collective has finished and returns its
  // status; never throws. With a finite timeout it returns DeadlineExceeded if
  // the collective is still running then (a peer is late or gone). The
  // collective stays posted: wait again, or end the job with AbortAll; nothing
  // else is safe. Calling Wait again after completion returns the same status.
  absl::Status Wait(absl::Duration timeout = absl::InfiniteDuration());

  // Blocking convenience for code that reports errors by exception (autograd
  // functions): waits at most CollectiveTimeout() (parallel/watchdog.h), with
  // the watchdog armed; a collective still running then ends the job with the
  // watchdog's message. Otherwise throws c10::Error with the status message
  // if it is not OK.
  void WaitOrThrow();

  // What this collective is, for messages: "AllToAllV on communicator 'ep'
  // (MPI, rank 1 of 4), world ranks 0-3 (12.0 KiB out, 8.0 KiB in)".
  // Optional; the default says only "a collective".
  virtual std::string Description() const { return "a collective"; }

  // A handle that is already complete with `status`: for collectives that had
  // nothing to move, and for failures detected before anything was posted.
  static std::shared_ptr<Work> Completed(absl::Status status);

 protected:
  // Wait() of the backend; `timeout` is absl::InfiniteDuration() for no limit.
  virtual absl::Status DoWait(absl::Duration timeout) = 0;
};

// A group of ranks that run collectives together. Every method except the
// accessors is collective: each rank of the group calls it, in the same order.
class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // This process's position in the group, in [0, size()).
  int rank() const { return rank_; }
  int size() const { return size_; }
  // The group's role, for messages: "world", "ep", "edp", ...
  const std::string& name() const { return name_; }

  // "MPI", "NCCL".
  virtual std::string BackendName() const = 0;
  // Where this backend's tensors must live.
  virtual c10::Device device() const = 0;

  // Optional capability: whether collectives may also be started from a
  // thread other than the one that made the communicator, while that thread
  // waits (autograd's device threads run gradient hooks during backward).
  // Still one thread at a time. MPI is started MPI_THREAD_FUNNELED: false.
  virtual bool PostsFromAnyThread() const { return false; }

  // Equal-split all-to-all of int64 counts. `send_counts` and `recv_counts` are
  // [size(), k...]: row p of send_counts goes to rank p, and row p of
  // recv_counts is what rank p sent here. Used before AllToAllV so that each
  // rank learns how many rows it will receive (k > 1 carries per-expert counts).
  virtual std::shared_ptr<Work> AllToAllCounts(const at::Tensor& send_counts,
                                               const at::Tensor& recv_counts);

  // All-to-all of rows with per-peer row counts. `send` is [sum(send_row_counts),
  // trailing...]; its first send_row_counts[0] rows go to rank 0, the next
  // send_row_counts[1] to rank 1, ... `recv` is [sum(recv_row_counts),
  // trailing...], same dtype and trailing shape, filled in rank order. Counts
  // may be zero (for any peer, or all of them); send_row_counts[p] on this rank
  // must equal recv_row_counts[rank()] on rank p, which AllToAllCounts ensures.
  virtual std::shared_ptr<Work> AllToAllV(const at::Tensor& send,
                                          absl::Span<const int64_t> send_row_counts,
                                          const at::Tensor& recv,
                                          absl::Span<const int64_t> recv_row_counts);

  // AllToAllV of the rows of `src` picked by `send_rows` ([sum(send_row_counts)]
  // int64 on the host, values in [0, src.size(0)), repeats allowed): the i-th
  // row sent is src[send_rows[i]], as if `send` were src.index_select(0,
  // send_rows). The default gathers them into a buffer and calls AllToAllV;
  // a backend may do better (MPI: its own rows are copied into place in recv
  // rather than through MPI).
  virtual std::shared_ptr<Work> AllToAllVGather(const at::Tensor& src, const at::Tensor& send_rows,
                                                absl::Span<const int64_t> send_row_counts,
                                                const at::Tensor& recv,
                                                absl::Span<const int64_t> recv_row_counts);

  // In-place element-wise reduction over the group: afterwards every rank holds
  // the same result. Floating types, including bf16 and fp16, and integers.
  virtual std::shared_ptr<Work> AllReduce(const at::Tensor& tensor, ReduceOp op);

  // `send` [n, trailing...] from every rank -> `recv` [size() * n, trailing...]
  // in rank order. n must be the same on all ranks.
  virtual std::shared_ptr<Work> AllGather(const at::Tensor& send, const at::Tensor& recv);

  // As AllGather, but rank p contributes recv_row_counts[p] rows (possibly 0);
  // `send` has recv_row_counts[rank()] rows.
  virtual std::shared_ptr<Work> AllGatherV(const at::Tensor& send, const at::Tensor& recv,
                                           absl::Span<const int64_t> recv_row_counts);

  // Copies `tensor` of rank `root_rank` into `tensor` of every other rank.
  virtual std::shared_ptr<Work> Broadcast(const at::Tensor& tensor, int root_rank);

  // Completes once every rank has entered it.
  virtual std::shared_ptr<Work> Barrier();

  // Blocking. Ranks that pass the same color >= 0 form a new communicator of
  // the same backend, ranked by (key, rank()); a rank that passes a negative
  // color joins none and gets nullptr. `name` labels the new group in messages
  // (empty: "<this name>/<color>").
  virtual absl::StatusOr<std::shared_ptr<Communicator>> Split(int color, int key, std::string name);

 protected:
  Communicator(int rank, int size, std::string name);

  // What the default bodies return: a completed Work with an Unimplemented
  // status naming the backend and the operation.
  std::shared_ptr<Work> NotImplemented(const char* op) const;

  // "'<name>' (<backend>, rank r of n)": the prefix of every error message.
  std::string Describe() const;

 private:
  const int rank_;
  const int size_;
  const std::string name_;
};

}  // namespace moefit::parallel
