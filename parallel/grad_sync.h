// Gradient synchronization: sums gradients over a group, in buckets.
//
// Small tensors are packed into flat buckets of one dtype (at most
// `bucket_bytes` each) so that a model with thousands of parameters costs a
// few large all-reduces rather than thousands of small ones. The loss is
// normalized by the global token count, so a plain sum is the global gradient.
//
// Two ways, with the same result:
//   * AllReduceSum, after backward: the slow twin, simple and obviously right;
//   * OverlappedGradSync, during backward: each bucket is all-reduced as soon
//     as autograd has accumulated the gradient of every parameter in it, while
//     backward goes on computing the earlier layers' gradients (as PyTorch
//     DDP's reducer does). Buckets fill in reverse parameter order, the order
//     backward produces gradients in, and are posted strictly in bucket order
//     on every rank, so the ranks' collectives always match even when a
//     parameter gets its gradient late, or not at all, on some rank.
// With two ranks each element's sum is one addition, so both give bitwise the
// same gradients; with more, the order MPI adds in may depend on message
// sizes, so they agree to rounding.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"

namespace moefit::parallel {

struct GradSyncOptions {
  int64_t bucket_bytes = 32 << 20;
};

// In place: each defined tensor becomes its sum over `comm`. Every rank must
// pass tensors of the same shapes and dtypes in the same order, and the same
// ones undefined. Throws c10::Error when a collective fails.
void AllReduceSum(Communicator& comm, const std::vector<at::Tensor>& tensors,
                  const GradSyncOptions& options = {});

// What the last OverlappedGradSync::Finish did, for step metrics and the
// benchmark.
struct GradSyncStats {
  int64_t num_buckets = 0;
  // Buckets posted by gradient hooks while backward was still running; the
  // rest were posted by Finish.
  int64_t num_posted_during_backward = 0;
  // Wall-clock seconds Finish spent posting the rest and waiting for every
  // bucket: the part of the all-reduce that backward did not hide.
  double finish_seconds = 0;
};

// All-reduces the gradients of `params` during backward. Use:
//   sync.Arm();            // before the backward whose gradients are final
//   loss.backward();       // buckets are posted as they fill
//   sync.Finish();         // posts the rest, waits, writes the sums to .grad()
// With gradient accumulation, only the last micro-batch's backward is armed:
// the earlier ones accumulate locally, and Finish picks up any gradient that
// the armed backward did not touch.
//
// After Finish, a parameter's .grad() is its sum over the group when any rank
// had a gradient for it (a rank without one counts as zeros), and stays
// undefined when no rank had one.
//
// Where a bucket is posted from: a gradient hook runs on the thread autograd
// runs the parameter's node on, the calling thread for CPU tensors and a
// device thread for CUDA ones. Buckets are posted from the hook when the
// communicator allows that thread (Communicator::PostsFromAnyThread, or the
// thread that made this object); otherwise they are filled there and posted
// by Finish. With a CUDA communicator a bucket runs on a side stream that
// first waits for the gradients' stream, so backward's kernels and the
// all-reduce run side by side. Each hook on the posting thread also polls the
// buckets in flight, which is what moves MPI's non-blocking collectives on.
//
// Every wait in Finish has the collective deadline (Work::WaitOrThrow,
// parallel/watchdog.h).
class OverlappedGradSync {
 public:
  // Collective over `comm`: splits a communicator of its own off it (the
  // buckets' collectives are posted at moments that differ between ranks, so
  // they must not share a communicator with anything else), allocates the
  // buckets on its device and hooks every parameter's gradient accumulator.
  // `params`: leaf tensors that require grad, of the same shapes and dtypes in
  // the same order on every rank. Keep the object alive while backward runs.
  static absl::StatusOr<std::unique_ptr<OverlappedGradSync>> Create(
      Communicator& comm, std::vector<at::Tensor> params, const GradSyncOptions& options = {});
  ~OverlappedGradSync();
  OverlappedGradSync(const OverlappedGradSync&) = delete;
  OverlappedGradSync& operator=(const OverlappedGradSync&) = delete;

  // The next backward's gradient hooks fill and post buckets. Call on the
  // thread that made this object; not while armed.
  void Arm();
  // Posts the buckets not posted yet, waits for all, and writes the sums into
  // the parameters' .grad(). Throws c10::Error if a collective fails, or if a
  // gradient was accumulated again after its bucket had been posted (a
  // second backward while armed). Call on the thread that made this object.
  void Finish();

  const GradSyncStats& last_stats() const;
  // Bucket b's parameters, as indices into `params` (for tests).
  std::vector<std::vector<int64_t>> bucket_params() const;

 private:
  struct Impl;
  explicit OverlappedGradSync(std::shared_ptr<Impl> impl);
  // Shared with the hooks, which may outlive this object inside autograd.
  std::shared_ptr<Impl> impl_;
};

}  // namespace moefit::parallel
