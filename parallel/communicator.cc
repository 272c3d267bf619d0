// Default bodies of the Communicator interface and the trivial completed Work.
//
// Every collective's default fails with Unimplemented and names the backend and
// the operation, so a backend that has not written one (or a test double) is
// diagnosed at the first Wait() instead of by a crash or a silent no-op.
#include "parallel/communicator.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "parallel/internal/collective_checks.h"
#include "parallel/progress.h"
#include "parallel/watchdog.h"

namespace moefit::parallel {
namespace {

class CompletedWork final : public Work {
 public:
  explicit CompletedWork(absl::Status status) : status_(std::move(status)) {}
  bool IsCompleted() override { return true; }

 protected:
  absl::Status DoWait(absl::Duration) override { return status_; }

 private:
  const absl::Status status_;
};

}  // namespace

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "unknown";
}

namespace {
std::atomic<int64_t> wait_ns{0};
}  // namespace

double CommunicationWaitSeconds() { return static_cast<double>(wait_ns.load()) * 1e-9; }

absl::Status Work::Wait(absl::Duration timeout) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status status = DoWait(timeout);
  wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                 std::chrono::steady_clock::now() - start)
                 .count();
  return status;
}

void Work::WaitOrThrow() {
  const absl::Duration timeout = CollectiveTimeout();
  absl::Status status;
  {
    WatchdogScope watch(Description(), timeout);
    status = Wait(timeout);
    if (absl::IsDeadlineExceeded(status)) {
      // Ends the job (AbortAll) unless a test replaced on_expire.
      watch.Expire();
      TORCH_CHECK(false, WatchdogMessage(Description(), timeout));
    }
  }
  if (status.ok()) RecordCompletedCollective(Description());
  TORCH_CHECK(status.ok(), status.ToString());
}

std::shared_ptr<Work> Work::Completed(absl::Status status) {
  return std::make_shared<CompletedWork>(std::move(status));
}

Communicator::Communicator(int rank, int size, std::string name)
    : rank_(rank), size_(size), name_(std::move(name)) {}

std::string Communicator::Describe() const {
  return absl::StrCat("communicator '", name_, "' (", BackendName(), ", rank ", rank_, " of ",
                      size_, ")");
}

std::shared_ptr<Work> Communicator::NotImplemented(const char* op) const {
  return Work::Completed(absl::UnimplementedError(
      absl::StrCat(BackendName(), " backend does not implement ", op, " (", Describe(), ")")));
}

std::shared_ptr<Work> Communicator::AllToAllCounts(const at::Tensor&, const at::Tensor&) {
  return NotImplemented("AllToAllCounts");
}

std::shared_ptr<Work> Communicator::AllToAllV(const at::Tensor&, absl::Span<const int64_t>,
                                              const at::Tensor&, absl::Span<const int64_t>) {
  return NotImplemented("AllToAllV");
}

std::shared_ptr<Work> Communicator::AllToAllVGather(const at::Tensor& src,
                                                    const at::Tensor& send_rows,
                                                    absl::Span<const int64_t> send_row_counts,
                                                    const at::Tensor& recv,
                                                    absl::Span<const int64_t> recv_row_counts) {
  internal::CheckAllToAllVGather(*this, src, send_rows, send_row_counts, recv, recv_row_counts);
  return AllToAllV(src.index_select(0, send_rows.to(src.device())), send_row_counts, recv,
                   recv_row_counts);
}

std::shared_ptr<Work> Communicator::AllReduce(const at::Tensor&, ReduceOp) {
  return NotImplemented("AllReduce");
}

std::shared_ptr<Work> Communicator::AllGather(const at::Tensor&, const at::Tensor&) {
  return NotImplemented("AllGather");
}

std::shared_ptr<Work> Communicator::AllGatherV(const at::Tensor&, const at::Tensor&,
                                               absl::Span<const int64_t>) {
  return NotImplemented("AllGatherV");
}

std::shared_ptr<Work> Communicator::Broadcast(const at::Tensor&, int) {
  return NotImplemented("Broadcast");
}

std::shared_ptr<Work> Communicator::Barrier() { return NotImplemented("Barrier"); }

absl::StatusOr<std::shared_ptr<Communicator>> Communicator::Split(int, int, std::string) {
  return absl::UnimplementedError(
      absl::StrCat(BackendName(), " backend does not implement Split (", Describe(), ")"));
}

}  // namespace moefit::parallel
