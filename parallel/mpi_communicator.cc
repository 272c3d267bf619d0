// The MPI backend of Communicator (see the header for the wire formats).
//
// Each collective checks its arguments (TORCH_CHECK, shared with every backend),
// then posts one or more non-blocking MPI calls into an MpiWork that owns
// everything MPI may touch until completion: the tensors, the int count arrays
// (MPI-3 forbids changing them while the call is pending) and, for bf16/fp16
// reductions, the fp32 staging copy and the step that rounds it back.
#include "parallel/mpi_communicator.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <exception>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "parallel/internal/collective_checks.h"
#include "parallel/internal/mpi_util.h"
#include "parallel/mpi_progress.h"
#include "parallel/watchdog.h"
#include "proto/status_macros.h"

namespace moefit::parallel {
namespace {

// What an MPI collective may read or write until it completes.
struct PendingMpi {
  std::vector<MPI_Request> requests;
  std::vector<at::Tensor> tensors;
  internal::MpiCounts send_counts;
  internal::MpiCounts recv_counts;
  // Runs once after all requests completed successfully (fp32 staging -> bf16).
  std::function<void()> on_success;
};

absl::Status WaitAll(std::vector<MPI_Request>& requests) {
  MOEFIT_CHECK_FOREIGN(
      MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE));
  return absl::OkStatus();
}

absl::Status TestAll(std::vector<MPI_Request>& requests, bool* done) {
  int flag = 0;
  MOEFIT_CHECK_FOREIGN(
      MPI_Testall(static_cast<int>(requests.size()), requests.data(), &flag, MPI_STATUSES_IGNORE));
  *done = flag != 0;
  return absl::OkStatus();
}

// How long a waiting collective is polled back to back (yielding the core
// between polls to any thread that wants it) before each further poll
// sleeps. Open MPI moves data only inside MPI calls, and a collective's
// messages travel in several steps (handshakes, fragments), each needing a
// poll: sleeping between polls would stretch an exchange to several times
// its length. Waits longer than this are peers that are late, where a
// sleeping poll leaves the core to other work.
constexpr absl::Duration kBusyPollTime = absl::Milliseconds(500);

// "12 B", "4.0 KiB", "1.5 MiB": sizes for messages.
std::string FormatBytes(int64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  const char* const units[] = {"KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes) / 1024;
  int unit = 0;
  for (; value >= 1024 && unit < 3; ++unit) value /= 1024;
  return absl::StrFormat("%.1f %s", value, units[unit]);
}

class MpiWork final : public Work {
 public:
  // `what` ("AllToAllV on communicator 'ep' (MPI, rank 1 of 4)") prefixes every
  // error this work reports.
  explicit MpiWork(std::string what)
      : what_(std::move(what)), pending_(std::make_unique<PendingMpi>()) {}

  ~MpiWork() override {
    if (completed_) return;
    if (std::uncaught_exceptions() > 0) {
      // Unwinding towards AbortAll: waiting could block forever on a peer that
      // is itself failing. Keep the buffers alive (MPI may still write them)
      // and let the abort end the process.
      (void)pending_.release();
      return;
    }
    const absl::Status status = Wait();
    if (!status.ok())
      std::fprintf(stderr, "moefit: dropped unwaited %s\n", status.ToString().c_str());
  }

  // Posts the MPI calls; a failure to post completes the work with that error.
  void Start(const std::function<absl::Status(PendingMpi&)>& post) {
    const absl::Status status = post(*pending_);
    if (!pending_->requests.empty()) {
      internal::NoteMpiWorkPosted();  // the progress thread, if any, runs
      counted_ = true;
    }
    if (!status.ok() || pending_->requests.empty()) Finish(status);
  }

  bool IsCompleted() override {
    if (completed_) return true;
    bool done = false;
    const absl::Status status = TestAll(pending_->requests, &done);
    if (!status.ok() || done) Finish(status);
    return completed_;
  }

  absl::Status DoWait(absl::Duration timeout) override {
    if (completed_) return status_;
    if (timeout == absl::InfiniteDuration()) {
      Finish(WaitAll(pending_->requests));
      return status_;
    }
    const absl::Time start = absl::Now();
    const absl::Time deadline = start + timeout;
    const absl::Time busy_until = start + kBusyPollTime;
    while (!IsCompleted()) {
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(what_, " did not finish within ",
                                                        absl::FormatDuration(timeout),
                                                        "; a peer is late, stuck or gone"));
      }
      // Polling keeps MPI progressing (see kBusyPollTime).
      if (now < busy_until) {
        std::this_thread::yield();
      } else {
        absl::SleepFor(absl::Microseconds(50));
      }
    }
    return status_;
  }

  std::string Description() const override { return what_; }

 private:
  void Finish(absl::Status status) {
    if (status.ok() && pending_->on_success) {
      try {
        pending_->on_success();
      } catch (const std::exception& error) {
        status = absl::InternalError(error.what());
      }
    }
    completed_ = true;
    if (counted_) internal::NoteMpiWorkFinished();
    if (status.ok()) {
      pending_.reset();
      status_ = absl::OkStatus();
      return;
    }
    // After a failure MPI may still own the buffers; the job is about to be
    // aborted, so keep them alive rather than risk a write into freed memory.
    (void)pending_.release();
    status_ = absl::Status(status.code(), absl::StrCat(what_, ": ", status.message()));
  }

  const std::string what_;
  std::unique_ptr<PendingMpi> pending_;
  bool completed_ = false;
  bool counted_ = false;  // NoteMpiWorkPosted was called
  absl::Status status_;
};

MPI_Op ToMpiOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return MPI_SUM;
    case ReduceOp::kMax:
      return MPI_MAX;
    case ReduceOp::kMin:
      return MPI_MIN;
  }
  TORCH_CHECK(false, "unknown ReduceOp ", static_cast<int>(op));
}

// An int count for a single-block MPI call, or OutOfRange naming `what`.
absl::StatusOr<int> ToIntCount(int64_t count, absl::string_view what) {
  if (count < 0 || count > INT_MAX) {
    return absl::OutOfRangeError(absl::StrCat(what, ": count ", count, " does not fit MPI's int"));
  }
  return static_cast<int>(count);
}

char* BytePointer(const at::Tensor& tensor) { return static_cast<char*>(tensor.data_ptr()); }

}  // namespace

namespace {

// "0-3" or "0,2,4,6": which ranks of MPI_COMM_WORLD `comm` holds, so that a
// message about a group names processes a user can find in mpirun's output.
absl::Status WorldRanksOf(MPI_Comm comm, int size, std::string* out) {
  MPI_Group group = MPI_GROUP_NULL;
  MPI_Group world_group = MPI_GROUP_NULL;
  MOEFIT_CHECK_FOREIGN(MPI_Comm_group(comm, &group));
  MOEFIT_CHECK_FOREIGN(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
  std::vector<int> ranks(size);
  std::vector<int> world_ranks(size);
  for (int i = 0; i < size; ++i) ranks[i] = i;
  const int translated =
      MPI_Group_translate_ranks(group, size, ranks.data(), world_group, world_ranks.data());
  MOEFIT_CHECK_FOREIGN(MPI_Group_free(&group));
  MOEFIT_CHECK_FOREIGN(MPI_Group_free(&world_group));
  MOEFIT_CHECK_FOREIGN(translated);
  bool consecutive = true;
  for (int i = 1; i < size; ++i) consecutive &= world_ranks[i] == world_ranks[i - 1] + 1;
  *out = consecutive && size > 1 ? absl::StrCat(world_ranks.front(), "-", world_ranks.back())
                                 : absl::StrJoin(world_ranks, ",");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<MpiCommunicator>> MpiCommunicator::Create(
    MPI_Comm base, const MpiCommunicatorOptions& options) {
  MPI_Comm comm = MPI_COMM_NULL;
  {
    // Blocking and collective: a missing peer would hang it for ever.
    WatchdogScope watch(absl::StrCat("MPI_Comm_dup creating communicator '", options.name, "'"));
    MOEFIT_CHECK_FOREIGN(MPI_Comm_dup(base, &comm));
  }
  return Adopt(comm, options);
}

absl::StatusOr<std::shared_ptr<MpiCommunicator>> MpiCommunicator::Adopt(
    MPI_Comm comm, MpiCommunicatorOptions options) {
  int rank = 0;
  int size = 0;
  std::string world_ranks;
  const absl::Status status = [&]() -> absl::Status {
    MOEFIT_CHECK_FOREIGN(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    MOEFIT_CHECK_FOREIGN(MPI_Comm_rank(comm, &rank));
    MOEFIT_CHECK_FOREIGN(MPI_Comm_size(comm, &size));
    return WorldRanksOf(comm, size, &world_ranks);
  }();
  if (!status.ok()) {
    // Best effort on a communicator that is already failing; the first error
    // is the one worth reporting.
    (void)MPI_Comm_free(&comm);
    return status;
  }
  TORCH_CHECK(options.max_elements_per_call > 0,
              "MpiCommunicatorOptions.max_elements_per_call must be positive");
  return std::shared_ptr<MpiCommunicator>(
      new MpiCommunicator(comm, rank, size, std::move(options), std::move(world_ranks)));
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, int rank, int size, MpiCommunicatorOptions options,
                                 std::string world_ranks)
    : Communicator(rank, size, options.name),
      comm_(comm),
      options_(std::move(options)),
      world_ranks_(std::move(world_ranks)) {}

MpiCommunicator::~MpiCommunicator() {
  const absl::Status status = Free();
  if (!status.ok())
    std::fprintf(stderr, "moefit: freeing %s: %s\n", Describe().c_str(), status.ToString().c_str());
}

std::string MpiCommunicator::WorkName(absl::string_view op, int64_t send_bytes,
                                      int64_t recv_bytes) const {
  std::string name = absl::StrCat(op, " on ", Describe(), ", world ranks ", world_ranks_);
  if (send_bytes > 0 || recv_bytes > 0) {
    absl::StrAppend(&name, " (", FormatBytes(send_bytes), " out, ", FormatBytes(recv_bytes),
                    " in)");
  }
  return name;
}

int64_t MpiCommunicator::MaxCountPerCall() const {
  return std::min<int64_t>(options_.max_elements_per_call, INT_MAX);
}

absl::Status MpiCommunicator::Free() {
  int finalized = 0;
  MOEFIT_CHECK_FOREIGN(MPI_Finalized(&finalized));
  if (!finalized && comm_ != MPI_COMM_NULL) MOEFIT_CHECK_FOREIGN(MPI_Comm_free(&comm_));
  return absl::OkStatus();
}

namespace {

std::shared_ptr<Work> Post(std::string what, const std::function<absl::Status(PendingMpi&)>& post) {
  auto work = std::make_shared<MpiWork>(std::move(what));
  work->Start(post);
  return work;
}

// Posts the all-to-all-v of the rows for the other ranks, in `row_type`:
// `send` and `recv` laid out by the counts' displacements, whose entries for
// rank `me` are left out (its own rows are the caller's to copy). `what`
// names the call in count errors.
// `send_starts`, where given, is the row of `send` each peer's block starts
// at (the blocks then need not follow each other); by default they do.
absl::Status PostOthersRows(PendingMpi& pending, const at::Tensor& send,
                            absl::Span<const int64_t> send_row_counts, const at::Tensor& recv,
                            absl::Span<const int64_t> recv_row_counts, int me,
                            MPI_Datatype row_type, MPI_Comm comm, absl::string_view what,
                            absl::Span<const int64_t> send_starts = {}) {
  absl::StatusOr<internal::MpiCounts> send_counts =
      internal::ToMpiCounts(send_row_counts, absl::StrCat(what, " send rows"));
  if (!send_counts.ok()) return send_counts.status();
  for (size_t q = 0; q < send_starts.size(); ++q) {
    if (send_starts[q] > INT_MAX) {
      return absl::OutOfRangeError(absl::StrCat(what, ": rank ", q, "'s rows start at row ",
                                                send_starts[q], ", above INT_MAX (", INT_MAX,
                                                "), which MPI displacements cannot express"));
    }
    send_counts->displacements[q] = static_cast<int>(send_starts[q]);
  }
  absl::StatusOr<internal::MpiCounts> recv_counts =
      internal::ToMpiCounts(recv_row_counts, absl::StrCat(what, " recv rows"));
  if (!recv_counts.ok()) return recv_counts.status();
  send_counts->counts[me] = recv_counts->counts[me] = 0;
  pending.send_counts = *std::move(send_counts);
  pending.recv_counts = *std::move(recv_counts);
  pending.tensors = {send, recv};
  MOEFIT_CHECK_FOREIGN(MPI_Ialltoallv(
      send.data_ptr(), pending.send_counts.counts.data(), pending.send_counts.displacements.data(),
      row_type, recv.data_ptr(), pending.recv_counts.counts.data(),
      pending.recv_counts.displacements.data(), row_type, comm, &pending.requests.emplace_back()));
  return absl::OkStatus();
}

}  // namespace

std::shared_ptr<Work> MpiCommunicator::AllToAllCounts(const at::Tensor& send_counts,
                                                      const at::Tensor& recv_counts) {
  internal::CheckAllToAllCounts(*this, send_counts, recv_counts);
  const std::string what = WorkName("AllToAllCounts", send_counts.nbytes(), recv_counts.nbytes());
  return Post(what, [&](PendingMpi& pending) -> absl::Status {
    const absl::StatusOr<int> per_peer = ToIntCount(send_counts.numel() / size(), "AllToAllCounts");
    if (!per_peer.ok()) return per_peer.status();
    pending.tensors = {send_counts, recv_counts};
    MOEFIT_CHECK_FOREIGN(MPI_Ialltoall(send_counts.data_ptr(), *per_peer, MPI_INT64_T,
                                       recv_counts.data_ptr(), *per_peer, MPI_INT64_T, comm_,
                                       &pending.requests.emplace_back()));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> MpiCommunicator::AllToAllV(const at::Tensor& send,
                                                 absl::Span<const int64_t> send_row_counts,
                                                 const at::Tensor& recv,
                                                 absl::Span<const int64_t> recv_row_counts) {
  internal::CheckAllToAllV(*this, send, send_row_counts, recv, recv_row_counts);
  const std::string what = WorkName("AllToAllV", send.nbytes(), recv.nbytes());
  return Post(what, [&](PendingMpi& pending) -> absl::Status {
    const int64_t row_bytes = internal::RowBytes(send);
    if (row_bytes == 0)
      return absl::OkStatus();  // rows of zero elements: nothing to move on any rank
    internal::ScopedRowType row_type;
    if (absl::Status status = row_type.Init(row_bytes, "AllToAllV"); !status.ok()) return status;
    const int me = rank();
    MOEFIT_RETURN_IF_ERROR(PostOthersRows(pending, send, send_row_counts, recv, recv_row_counts, me,
                                          row_type.get(), comm_, "AllToAllV"));
    // This rank's own rows copied here (on LibTorch's threads), not by MPI.
    if (send_row_counts[me] > 0) {
      recv.narrow(0, internal::BlockStart(recv_row_counts, me), recv_row_counts[me])
          .copy_(send.narrow(0, internal::BlockStart(send_row_counts, me), send_row_counts[me]));
    }
    return absl::OkStatus();
  });
}

// The rows for the other ranks are gathered into one buffer, in parallel,
// and travel as AllToAllV's contiguous blocks; this rank's own rows are
// gathered straight into their place in recv and not handed to MPI. Over
// shared memory MPI moves a contiguous block in one copy (CMA), where rows
// read where they lie through a derived datatype were packed into and out of
// its fragments, two copies on MPI's one thread, which dispatch_bench
// measured as the slower way between two processes on one node. Where each other
// rank's rows are already one block of src (ascending consecutive rows),
// those blocks are sent where they lie, with no gather.
std::shared_ptr<Work> MpiCommunicator::AllToAllVGather(const at::Tensor& src,
                                                       const at::Tensor& send_rows,
                                                       absl::Span<const int64_t> send_row_counts,
                                                       const at::Tensor& recv,
                                                       absl::Span<const int64_t> recv_row_counts) {
  internal::CheckAllToAllVGather(*this, src, send_rows, send_row_counts, recv, recv_row_counts);
  const int64_t row_bytes = internal::RowBytes(src);
  const std::string what =
      WorkName("AllToAllVGather", send_rows.numel() * row_bytes, recv.nbytes());
  return Post(what, [&](PendingMpi& pending) -> absl::Status {
    if (row_bytes == 0) return absl::OkStatus();
    internal::ScopedRowType row_type;
    if (absl::Status status = row_type.Init(row_bytes, "AllToAllVGather"); !status.ok())
      return status;
    // The other ranks' rows packed together, this rank's own in place.
    const int me = rank();
    const int64_t own_begin = internal::BlockStart(send_row_counts, me), own = send_row_counts[me];
    std::vector<int64_t> send_counts(send_row_counts.begin(), send_row_counts.end());
    send_counts[me] = 0;
    const std::vector<int64_t> starts = internal::RowRunStarts(send_rows, send_row_counts, me);
    if (!starts.empty()) {
      MOEFIT_RETURN_IF_ERROR(PostOthersRows(pending, src, send_counts, recv, recv_row_counts, me,
                                            row_type.get(), comm_, "AllToAllVGather", starts));
    } else {
      const int64_t after = send_rows.size(0) - own_begin - own;
      const at::Tensor others =
          at::cat({send_rows.narrow(0, 0, own_begin), send_rows.narrow(0, own_begin + own, after)});
      MOEFIT_RETURN_IF_ERROR(PostOthersRows(pending, src.index_select(0, others), send_counts, recv,
                                            recv_row_counts, me, row_type.get(), comm_,
                                            "AllToAllVGather"));
    }
    if (own > 0) {
      at::Tensor own_rows = recv.narrow(0, internal::BlockStart(recv_row_counts, me), own);
      at::index_select_out(own_rows, src, 0, send_rows.narrow(0, own_begin, own));
    }
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> MpiCommunicator::AllReduce(const at::Tensor& tensor, ReduceOp op) {
  internal::CheckAllReduce(*this, tensor);
  const std::string what =
      WorkName(absl::StrCat("AllReduce(", ReduceOpName(op), ")"), tensor.nbytes(), tensor.nbytes());
  return Post(what, [&](PendingMpi& pending) -> absl::Status {
    at::Tensor buffer = tensor;
    if (tensor.scalar_type() == at::kBFloat16 || tensor.scalar_type() == at::kHalf) {
      // No MPI type: reduce an fp32 copy, round back once at the end.
      buffer = tensor.to(at::kFloat);
      pending.on_success = [tensor, buffer] { tensor.copy_(buffer); };
    }
    pending.tensors = {tensor, buffer};
    const MPI_Datatype type = internal::ReductionDatatype(buffer.scalar_type());
    const MPI_Op mpi_op = ToMpiOp(op);
    const int64_t element_bytes = buffer.element_size();
    const int64_t max_count = MaxCountPerCall();
    for (int64_t offset = 0; offset < buffer.numel(); offset += max_count) {
      const int64_t count = std::min(max_count, buffer.numel() - offset);
      MOEFIT_CHECK_FOREIGN(MPI_Iallreduce(
          MPI_IN_PLACE, BytePointer(buffer) + offset * element_bytes, static_cast<int>(count), type,
          mpi_op, comm_, &pending.requests.emplace_back()));
    }
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> MpiCommunicator::AllGather(const at::Tensor& send, const at::Tensor& recv) {
  internal::CheckAllGather(*this, send, recv);
  const std::string what = WorkName("AllGather", send.nbytes(), recv.nbytes());
  return Post(what, [&](PendingMpi& pending) -> absl::Status {
    const int64_t row_bytes = internal::RowBytes(send);
    if (row_bytes == 0 || send.size(0) == 0) return absl::OkStatus();  // the same on every rank
    internal::ScopedRowType row_type;
    if (absl::Status status = row_type.Init(row_bytes, "AllGather"); !status.ok()) return status;
    const absl::StatusOr<int> num_rows = ToIntCount(recv.size(0), "AllGather rows");
    if (!num_rows.ok()) return num_rows.status();
    pending.tensors = {send, recv};
    const int num_send_rows = static_cast<int>(send.size(0));
    MOEFIT_CHECK_FOREIGN(MPI_Iallgather(send.data_ptr(), num_send_rows, row_type.get(),
                                        recv.data_ptr(), num_send_rows, row_type.get(), comm_,
                                        &pending.requests.emplace_back()));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> MpiCommunicator::AllGatherV(const at::Tensor& send, const at::Tensor& recv,
                                                  absl::Span<const int64_t> recv_row_counts) {
  internal::CheckAllGatherV(*this, send, recv, recv_row_counts);
  const std::string what = WorkName("AllGatherV", send.nbytes(), recv.nbytes());
  return Post(what, [&](PendingMpi& pending) -> absl::Status {
    const int64_t row_bytes = internal::RowBytes(send);
    if (row_bytes == 0) return absl::OkStatus();
    internal::ScopedRowType row_type;
    if (absl::Status status = row_type.Init(row_bytes, "AllGatherV"); !status.ok()) return status;
    absl::StatusOr<internal::MpiCounts> recv_counts =
        internal::ToMpiCounts(recv_row_counts, "AllGatherV rows");
    if (!recv_counts.ok()) return recv_counts.status();
    pending.recv_counts = *std::move(recv_counts);
    pending.tensors = {send, recv};
    MOEFIT_CHECK_FOREIGN(MPI_Iallgatherv(
        send.data_ptr(), pending.recv_counts.counts[rank()], row_type.get(), recv.data_ptr(),
        pending.recv_counts.counts.data(), pending.recv_counts.displacements.data(), row_type.get(),
        comm_, &pending.requests.emplace_back()));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> MpiCommunicator::Broadcast(const at::Tensor& tensor, int root_rank) {
  internal::CheckBroadcast(*this, tensor, root_rank);
  const std::string what =
      WorkName(absl::StrCat("Broadcast from rank ", root_rank), tensor.nbytes(), tensor.nbytes());
  return Post(what, [&](PendingMpi& pending) -> absl::Status {
    // Raw data, no arithmetic: any dtype travels as same-width integers.
    int64_t unit_bytes = 1;
    const MPI_Datatype unit = internal::CopyUnit(tensor.element_size(), &unit_bytes);
    const int64_t num_units = static_cast<int64_t>(tensor.nbytes()) / unit_bytes;
    pending.tensors = {tensor};
    const int64_t max_count = MaxCountPerCall();
    for (int64_t offset = 0; offset < num_units; offset += max_count) {
      const int64_t count = std::min(max_count, num_units - offset);
      MOEFIT_CHECK_FOREIGN(MPI_Ibcast(BytePointer(tensor) + offset * unit_bytes,
                                      static_cast<int>(count), unit, root_rank, comm_,
                                      &pending.requests.emplace_back()));
    }
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> MpiCommunicator::Barrier() {
  return Post(WorkName("Barrier", 0, 0), [&](PendingMpi& pending) -> absl::Status {
    MOEFIT_CHECK_FOREIGN(MPI_Ibarrier(comm_, &pending.requests.emplace_back()));
    return absl::OkStatus();
  });
}

absl::StatusOr<std::shared_ptr<Communicator>> MpiCommunicator::Split(int color, int key,
                                                                     std::string name) {
  MPI_Comm sub_comm = MPI_COMM_NULL;
  {
    WatchdogScope watch(absl::StrCat("MPI_Comm_split of ", Describe()));
    MOEFIT_CHECK_FOREIGN(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub_comm));
  }
  if (sub_comm == MPI_COMM_NULL) return std::shared_ptr<Communicator>();
  MpiCommunicatorOptions sub_options = options_;
  sub_options.name = name.empty() ? absl::StrCat(this->name(), "/", color) : std::move(name);
  absl::StatusOr<std::shared_ptr<MpiCommunicator>> sub = Adopt(sub_comm, std::move(sub_options));
  if (!sub.ok()) return sub.status();
  return std::shared_ptr<Communicator>(*std::move(sub));
}

}  // namespace moefit::parallel
