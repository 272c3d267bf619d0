// The NCCL backend of Communicator (see the header for stream semantics and
// wire formats). Compiled only when CMake found NCCL (MOEFIT_HAS_NCCL).
//
// Each collective checks its arguments (shared with every backend), enqueues
// NCCL calls on the device's current stream, records a CUDA event after them
// and returns an NcclWork that polls that event and NCCL's asynchronous error
// state. NCCL, CUDA and (for the unique id) MPI codes all go through
// MOEFIT_CHECK_FOREIGN; the first two learn how here.
#include "parallel/nccl_communicator.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "parallel/foreign_check.h"
#include "parallel/internal/collective_checks.h"
#include "parallel/watchdog.h"

namespace moefit::parallel {

template <>
struct ForeignCode<ncclResult_t> {
  static constexpr const char* kLibrary = "NCCL";
  static bool Ok(ncclResult_t code) { return code == ncclSuccess; }
  static std::string Describe(ncclResult_t code) {
    // The last error text often names the peer or the transport that failed.
    const char* detail = ncclGetLastError(nullptr);
    return absl::StrCat(ncclGetErrorString(code), detail != nullptr && *detail != '\0' ? "; " : "",
                        detail != nullptr ? detail : "");
  }
};

template <>
struct ForeignCode<cudaError_t> {
  static constexpr const char* kLibrary = "CUDA";
  static bool Ok(cudaError_t code) { return code == cudaSuccess; }
  static std::string Describe(cudaError_t code) {
    return absl::StrCat(cudaGetErrorName(code), ": ", cudaGetErrorString(code));
  }
};

namespace {

// A span of bytes inside a tensor, for one peer.
struct Block {
  int64_t offset = 0;
  int64_t num_bytes = 0;
};

// Consecutive blocks of counts[p] * unit_bytes bytes.
std::vector<Block> PackedBlocks(absl::Span<const int64_t> counts, int64_t unit_bytes) {
  std::vector<Block> blocks(counts.size());
  int64_t offset = 0;
  for (size_t peer_idx = 0; peer_idx < counts.size(); ++peer_idx) {
    blocks[peer_idx] = {offset, counts[peer_idx] * unit_bytes};
    offset += blocks[peer_idx].num_bytes;
  }
  return blocks;
}

char* BytePointer(const at::Tensor& tensor) { return static_cast<char*>(tensor.data_ptr()); }

absl::Status CheckAsyncError(ncclComm* comm) {
  ncclResult_t async_error = ncclSuccess;
  MOEFIT_CHECK_FOREIGN(ncclCommGetAsyncError(comm, &async_error));
  if (async_error == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("NCCL reported an asynchronous error: ",
                                          ForeignCode<ncclResult_t>::Describe(async_error)));
}

// Sends block send[p] of `send` to every peer p and receives block recv[p] of
// `recv` from it, as one NCCL group; the block a rank keeps is a device copy.
absl::Status ExchangeBlocks(ncclComm* comm, int rank, const at::Tensor& send,
                            const std::vector<Block>& send_blocks, const at::Tensor& recv,
                            const std::vector<Block>& recv_blocks, cudaStream_t stream) {
  const int num_peers = static_cast<int>(send_blocks.size());
  MOEFIT_CHECK_FOREIGN(ncclGroupStart());
  const absl::Status posted = [&]() -> absl::Status {
    for (int peer_idx = 0; peer_idx < num_peers; ++peer_idx) {
      if (peer_idx == rank) continue;
      const Block& out = send_blocks[peer_idx];
      const Block& in = recv_blocks[peer_idx];
      if (out.num_bytes > 0) {
        MOEFIT_CHECK_FOREIGN(ncclSend(BytePointer(send) + out.offset, out.num_bytes, ncclUint8,
                                      peer_idx, comm, stream));
      }
      if (in.num_bytes > 0) {
        MOEFIT_CHECK_FOREIGN(ncclRecv(BytePointer(recv) + in.offset, in.num_bytes, ncclUint8,
                                      peer_idx, comm, stream));
      }
    }
    return absl::OkStatus();
  }();
  // The group must be closed even when posting failed, or NCCL stays inside it.
  const absl::Status closed = [&]() -> absl::Status {
    MOEFIT_CHECK_FOREIGN(ncclGroupEnd());
    return absl::OkStatus();
  }();
  if (!posted.ok()) return posted;
  if (!closed.ok()) return closed;
  const Block& own_out = send_blocks[rank];
  if (own_out.num_bytes > 0) {
    MOEFIT_CHECK_FOREIGN(cudaMemcpyAsync(BytePointer(recv) + recv_blocks[rank].offset,
                                         BytePointer(send) + own_out.offset, own_out.num_bytes,
                                         cudaMemcpyDeviceToDevice, stream));
  }
  return absl::OkStatus();
}

ncclRedOp_t ToNcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  TORCH_CHECK(false, "unknown ReduceOp ", static_cast<int>(op));
}

ncclDataType_t ToNcclType(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return ncclFloat32;
    case c10::ScalarType::Double:
      return ncclFloat64;
    case c10::ScalarType::Half:
      return ncclFloat16;
    case c10::ScalarType::BFloat16:
      return ncclBfloat16;
    case c10::ScalarType::Long:
      return ncclInt64;
    case c10::ScalarType::Int:
      return ncclInt32;
    case c10::ScalarType::Char:
      return ncclInt8;
    case c10::ScalarType::Byte:
      return ncclUint8;
    default:
      TORCH_CHECK(false, "NCCL cannot reduce ", dtype);
  }
}

class NcclWork final : public Work {
 public:
  NcclWork(std::string what, std::shared_ptr<ncclComm> comm, int device_idx,
           std::vector<at::Tensor> tensors)
      : what_(std::move(what)),
        comm_(std::move(comm)),
        device_idx_(device_idx),
        tensors_(std::move(tensors)) {}

  ~NcclWork() override {
    if (event_ == nullptr) return;
    const absl::Status status = [&]() -> absl::Status {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_idx_));
      MOEFIT_CHECK_FOREIGN(cudaEventDestroy(event_));
      return absl::OkStatus();
    }();
    if (!status.ok())
      std::fprintf(stderr, "moefit: %s: %s\n", what_.c_str(), status.ToString().c_str());
  }

  // Marks the end of the enqueued collective on `stream`.
  absl::Status Record(cudaStream_t stream) {
    MOEFIT_CHECK_FOREIGN(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    MOEFIT_CHECK_FOREIGN(cudaEventRecord(event_, stream));
    return absl::OkStatus();
  }

  void Finish(absl::Status status) {
    completed_ = true;
    status_ = status.ok()
                  ? status
                  : absl::Status(status.code(), absl::StrCat(what_, ": ", status.message()));
  }

  bool IsCompleted() override {
    if (completed_) return true;
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_idx_));
    const cudaError_t query = cudaEventQuery(event_);
    if (query == cudaErrorNotReady) {
      (void)cudaGetLastError();  // "not ready" is not an error; do not leave it for others to find
      const absl::Status async = CheckAsyncError(comm_.get());
      if (!async.ok()) Finish(async);
      return completed_;
    }
    // The macro's expansion, spelled out: the call was made above because
    // "not ready" had to be told apart from failure first.
    absl::Status done = internal::ForeignCallStatus(query, "cudaEventQuery", __FILE__, __LINE__);
    if (done.ok()) done = CheckAsyncError(comm_.get());
    Finish(done);
    return true;
  }

  absl::Status DoWait(absl::Duration timeout) override {
    const absl::Time deadline =
        timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
    while (!IsCompleted()) {
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(what_, " did not finish within ",
                                                        absl::FormatDuration(timeout),
                                                        "; a peer is late, stuck or gone"));
      }
      absl::SleepFor(absl::Microseconds(20));
    }
    return status_;
  }

  std::string Description() const override { return what_; }

 private:
  const std::string what_;
  const std::shared_ptr<ncclComm> comm_;
  const int device_idx_;
  // Kept until the handle goes; stream order already protects them as long as
  // they belong to the stream the collective ran on.
  const std::vector<at::Tensor> tensors_;
  cudaEvent_t event_ = nullptr;
  bool completed_ = false;
  absl::Status status_;
};

// Enqueues `enqueue` on the current stream of `device_idx` and returns the
// Work that tracks it.
std::shared_ptr<Work> Launch(std::string what, const std::shared_ptr<ncclComm>& comm,
                             int device_idx, std::vector<at::Tensor> tensors,
                             const std::function<absl::Status(cudaStream_t)>& enqueue) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_idx));
  const cudaStream_t stream =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_idx)).stream();
  auto work = std::make_shared<NcclWork>(std::move(what), comm, device_idx, std::move(tensors));
  absl::Status status = enqueue(stream);
  if (status.ok()) status = work->Record(stream);
  if (!status.ok()) work->Finish(status);
  return work;
}

std::shared_ptr<ncclComm> OwnComm(ncclComm* comm) {
  return std::shared_ptr<ncclComm>(comm, [](ncclComm* owned) {
    // While an exception unwinds towards AbortAll, peers may never join the
    // pending collectives: abort instead of waiting for them.
    const absl::Status status = [&]() -> absl::Status {
      if (std::uncaught_exceptions() > 0) {
        MOEFIT_CHECK_FOREIGN(ncclCommAbort(owned));
      } else {
        MOEFIT_CHECK_FOREIGN(ncclCommDestroy(owned));
      }
      return absl::OkStatus();
    }();
    if (!status.ok())
      std::fprintf(stderr, "moefit: releasing an NCCL communicator: %s\n",
                   status.ToString().c_str());
  });
}

}  // namespace

absl::StatusOr<std::shared_ptr<NcclCommunicator>> NcclCommunicator::Create(
    std::shared_ptr<Communicator> bootstrap, const NcclCommunicatorOptions& options) {
  if (bootstrap == nullptr || !bootstrap->device().is_cpu()) {
    return absl::InvalidArgumentError(
        "NcclCommunicator needs a CPU communicator (MPI) to bootstrap over");
  }
  if (c10::cuda::device_count() == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("NCCL communicator '", options.name, "': no CUDA device is visible"));
  }
  const int device_idx = options.device_idx >= 0 ? options.device_idx : c10::cuda::current_device();
  if (device_idx >= c10::cuda::device_count()) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL communicator '", options.name, "': CUDA device ", device_idx,
                     " does not exist (", c10::cuda::device_count(), " visible)"));
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_idx));

  // Rank 0 makes the id; everyone else learns it over the bootstrap group.
  ncclUniqueId unique_id;
  std::memset(&unique_id, 0, sizeof(unique_id));
  if (bootstrap->rank() == 0) MOEFIT_CHECK_FOREIGN(ncclGetUniqueId(&unique_id));
  at::Tensor id_bytes = at::empty({static_cast<int64_t>(sizeof(unique_id))}, at::kByte);
  std::memcpy(id_bytes.data_ptr(), &unique_id, sizeof(unique_id));
  // Both steps wait for every rank, so both have the collective deadline: a
  // rank that never arrives ends the job with the watchdog's message.
  const absl::Duration timeout = CollectiveTimeout();
  {
    const std::shared_ptr<Work> work = bootstrap->Broadcast(id_bytes, /*root_rank=*/0);
    WatchdogScope watch(work->Description(), timeout);
    const absl::Status status = work->Wait(timeout);
    if (absl::IsDeadlineExceeded(status)) watch.Expire();
    if (!status.ok()) return status;
  }
  std::memcpy(&unique_id, id_bytes.data_ptr(), sizeof(unique_id));

  ncclComm* raw_comm = nullptr;
  {
    // ncclCommInitRank blocks until every rank has called it; the watchdog's
    // background thread ends the job if it is still inside after the deadline.
    WatchdogScope watch(absl::StrCat("ncclCommInitRank of NCCL communicator '", options.name,
                                     "' (rank ", bootstrap->rank(), " of ", bootstrap->size(), ")"),
                        timeout);
    MOEFIT_CHECK_FOREIGN(
        ncclCommInitRank(&raw_comm, bootstrap->size(), unique_id, bootstrap->rank()));
  }
  return std::shared_ptr<NcclCommunicator>(
      new NcclCommunicator(OwnComm(raw_comm), std::move(bootstrap), device_idx, options.name));
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<ncclComm> comm,
                                   std::shared_ptr<Communicator> bootstrap, int device_idx,
                                   std::string name)
    : Communicator(bootstrap->rank(), bootstrap->size(), std::move(name)),
      comm_(std::move(comm)),
      bootstrap_(std::move(bootstrap)),
      device_idx_(device_idx) {}

NcclCommunicator::~NcclCommunicator() = default;

c10::Device NcclCommunicator::device() const {
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_idx_));
}

std::shared_ptr<Work> NcclCommunicator::AllToAllCounts(const at::Tensor& send_counts,
                                                       const at::Tensor& recv_counts) {
  internal::CheckAllToAllCounts(*this, send_counts, recv_counts);
  const int64_t block_bytes = static_cast<int64_t>(send_counts.nbytes()) / size();
  const std::vector<int64_t> blocks_per_peer(size(), 1);
  return Launch(absl::StrCat("AllToAllCounts on ", Describe()), comm_, device_idx_,
                {send_counts, recv_counts}, [&](cudaStream_t stream) {
                  return ExchangeBlocks(comm_.get(), rank(), send_counts,
                                        PackedBlocks(blocks_per_peer, block_bytes), recv_counts,
                                        PackedBlocks(blocks_per_peer, block_bytes), stream);
                });
}

std::shared_ptr<Work> NcclCommunicator::AllToAllV(const at::Tensor& send,
                                                  absl::Span<const int64_t> send_row_counts,
                                                  const at::Tensor& recv,
                                                  absl::Span<const int64_t> recv_row_counts) {
  internal::CheckAllToAllV(*this, send, send_row_counts, recv, recv_row_counts);
  const int64_t row_bytes = internal::RowBytes(send);
  return Launch(absl::StrCat("AllToAllV on ", Describe()), comm_, device_idx_, {send, recv},
                [&](cudaStream_t stream) {
                  return ExchangeBlocks(comm_.get(), rank(), send,
                                        PackedBlocks(send_row_counts, row_bytes), recv,
                                        PackedBlocks(recv_row_counts, row_bytes), stream);
                });
}

std::shared_ptr<Work> NcclCommunicator::AllToAllVGather(const at::Tensor& src,
                                                        const at::Tensor& send_rows,
                                                        absl::Span<const int64_t> send_row_counts,
                                                        const at::Tensor& recv,
                                                        absl::Span<const int64_t> recv_row_counts) {
  internal::CheckAllToAllVGather(*this, src, send_rows, send_row_counts, recv, recv_row_counts);
  const std::vector<int64_t> starts = internal::RowRunStarts(send_rows, send_row_counts);
  if (starts.empty()) {
    return Communicator::AllToAllVGather(src, send_rows, send_row_counts, recv, recv_row_counts);
  }
  const int64_t row_bytes = internal::RowBytes(src);
  std::vector<Block> send_blocks(send_row_counts.size());
  for (size_t p = 0; p < send_blocks.size(); ++p) {
    send_blocks[p] = {starts[p] * row_bytes, send_row_counts[p] * row_bytes};
  }
  return Launch(absl::StrCat("AllToAllVGather on ", Describe()), comm_, device_idx_, {src, recv},
                [&](cudaStream_t stream) {
                  return ExchangeBlocks(comm_.get(), rank(), src, send_blocks, recv,
                                        PackedBlocks(recv_row_counts, row_bytes), stream);
                });
}

std::shared_ptr<Work> NcclCommunicator::AllReduce(const at::Tensor& tensor, ReduceOp op) {
  internal::CheckAllReduce(*this, tensor);
  const ncclDataType_t type = ToNcclType(tensor.scalar_type());
  const ncclRedOp_t nccl_op = ToNcclOp(op);
  return Launch(absl::StrCat("AllReduce(", ReduceOpName(op), ") on ", Describe()), comm_,
                device_idx_, {tensor}, [&](cudaStream_t stream) -> absl::Status {
                  MOEFIT_CHECK_FOREIGN(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(),
                                                     static_cast<size_t>(tensor.numel()), type,
                                                     nccl_op, comm_.get(), stream));
                  return absl::OkStatus();
                });
}

std::shared_ptr<Work> NcclCommunicator::AllGather(const at::Tensor& send, const at::Tensor& recv) {
  internal::CheckAllGather(*this, send, recv);
  return Launch(
      absl::StrCat("AllGather on ", Describe()), comm_, device_idx_, {send, recv},
      [&](cudaStream_t stream) -> absl::Status {
        if (send.nbytes() == 0) return absl::OkStatus();  // the same on every rank
        MOEFIT_CHECK_FOREIGN(ncclAllGather(send.data_ptr(), recv.data_ptr(), send.nbytes(),
                                           ncclUint8, comm_.get(), stream));
        return absl::OkStatus();
      });
}

std::shared_ptr<Work> NcclCommunicator::AllGatherV(const at::Tensor& send, const at::Tensor& recv,
                                                   absl::Span<const int64_t> recv_row_counts) {
  internal::CheckAllGatherV(*this, send, recv, recv_row_counts);
  const int64_t row_bytes = internal::RowBytes(send);
  // The same block of `send` goes to every peer.
  const std::vector<Block> send_blocks(size(), Block{0, static_cast<int64_t>(send.nbytes())});
  return Launch(absl::StrCat("AllGatherV on ", Describe()), comm_, device_idx_, {send, recv},
                [&](cudaStream_t stream) {
                  return ExchangeBlocks(comm_.get(), rank(), send, send_blocks, recv,
                                        PackedBlocks(recv_row_counts, row_bytes), stream);
                });
}

std::shared_ptr<Work> NcclCommunicator::Broadcast(const at::Tensor& tensor, int root_rank) {
  internal::CheckBroadcast(*this, tensor, root_rank);
  return Launch(
      absl::StrCat("Broadcast from rank ", root_rank, " on ", Describe()), comm_, device_idx_,
      {tensor}, [&](cudaStream_t stream) -> absl::Status {
        if (tensor.nbytes() == 0) return absl::OkStatus();
        MOEFIT_CHECK_FOREIGN(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.nbytes(),
                                           ncclUint8, root_rank, comm_.get(), stream));
        return absl::OkStatus();
      });
}

std::shared_ptr<Work> NcclCommunicator::Barrier() {
  const at::Tensor token = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device()));
  return Launch(absl::StrCat("Barrier on ", Describe()), comm_, device_idx_, {token},
                [&](cudaStream_t stream) -> absl::Status {
                  MOEFIT_CHECK_FOREIGN(ncclAllReduce(token.data_ptr(), token.data_ptr(), 1,
                                                     ncclFloat32, ncclSum, comm_.get(), stream));
                  return absl::OkStatus();
                });
}

absl::StatusOr<std::shared_ptr<Communicator>> NcclCommunicator::Split(int color, int key,
                                                                      std::string name) {
  if (name.empty()) name = absl::StrCat(this->name(), "/", color);
  absl::StatusOr<std::shared_ptr<Communicator>> sub_bootstrap = bootstrap_->Split(color, key, name);
  if (!sub_bootstrap.ok()) return sub_bootstrap.status();
  if (*sub_bootstrap == nullptr) return std::shared_ptr<Communicator>();
  absl::StatusOr<std::shared_ptr<NcclCommunicator>> sub =
      Create(*std::move(sub_bootstrap),
             NcclCommunicatorOptions{.name = std::move(name), .device_idx = device_idx_});
  if (!sub.ok()) return sub.status();
  return std::shared_ptr<Communicator>(*std::move(sub));
}

}  // namespace moefit::parallel
