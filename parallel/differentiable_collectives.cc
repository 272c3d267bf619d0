// Autograd functions over Communicator collectives; see differentiable_collectives.h.
#include "parallel/differentiable_collectives.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <numeric>

#include "parallel/progress.h"

namespace moefit::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t Sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

std::vector<int64_t> Shape(const at::Tensor& x, int64_t rows) {
  std::vector<int64_t> s = x.sizes().vec();
  s[0] = rows;
  return s;
}

at::Tensor RunAllToAll(Communicator& comm, const at::Tensor& x, const std::vector<int64_t>& send,
                       const std::vector<int64_t>& recv) {
  at::Tensor in = x.contiguous();
  at::Tensor out = at::empty(Shape(in, Sum(recv)), in.options());
  comm.AllToAllV(in, send, out, recv)->WaitOrThrow();
  return out;
}

at::Tensor RunAllGather(Communicator& comm, const at::Tensor& x, const std::vector<int64_t>& rows) {
  at::Tensor in = x.contiguous();
  at::Tensor out = at::empty(Shape(in, Sum(rows)), in.options());
  comm.AllGatherV(in, out, rows)->WaitOrThrow();
  return out;
}

at::Tensor RunSumKeepOwn(Communicator& comm, const at::Tensor& x, const std::vector<int64_t>& rows) {
  at::Tensor sum = x.contiguous().clone();
  comm.AllReduce(sum, ReduceOp::kSum)->WaitOrThrow();
  const int64_t begin = std::accumulate(rows.begin(), rows.begin() + comm.rank(), int64_t{0});
  return sum.narrow(0, begin, rows[comm.rank()]).clone();
}

// Each member's row of x to its rank, read where it lies (AllToAllVGather).
at::Tensor RunSendRows(Communicator& comm, const at::Tensor& x, const internal::RowRelation& rel,
                       const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
  at::Tensor in = x.contiguous();
  at::Tensor out = at::empty(Shape(in, Sum(recv)), in.options());
  comm.AllToAllVGather(in, internal::GroupOf(rel), send, out, recv)->WaitOrThrow();
  return out;
}

// Rows back from the ranks, each group of the relation summing its members.
at::Tensor RunReturnRows(Communicator& comm, const at::Tensor& x, const internal::RowRelation& rel,
                         const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
  return internal::Collect(RunAllToAll(comm, x, send, recv), rel);
}

// The layer and phase of the forward collective, so that a watchdog report
// from its backward (run later, maybe on autograd's thread) names them too.
void SaveProgress(AutogradContext* ctx) {
  ctx->saved_data["layer"] = CurrentLayer();
  ctx->saved_data["phase"] = reinterpret_cast<int64_t>(CurrentPhase());
}

// What SaveProgress kept, current for the lifetime of a backward.
class BackwardProgress {
 public:
  explicit BackwardProgress(AutogradContext* ctx)
      : layer_(ctx->saved_data["layer"].toInt()),
        phase_(reinterpret_cast<const char*>(ctx->saved_data["phase"].toInt()),
               /*backward=*/true) {}

 private:
  ScopedLayer layer_;
  ScopedPhase phase_;
};

Communicator* SavedComm(AutogradContext* ctx) {
  return reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt());
}

// The route MoveRowsFn keeps: the relation and the per-peer
// row counts of their forward.
void SaveRoute(AutogradContext* ctx, Communicator* comm, const internal::RowRelation& rel,
               const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
  ctx->saved_data["comm"] = reinterpret_cast<int64_t>(comm);
  SaveProgress(ctx);
  ctx->saved_data["members"] = rel.members;
  ctx->saved_data["slot"] = rel.slot;
  ctx->saved_data["send"] = send;
  ctx->saved_data["recv"] = recv;
}

internal::RowRelation SavedRelation(AutogradContext* ctx) {
  return {ctx->saved_data["members"].toTensor(), ctx->saved_data["slot"].toTensor()};
}

// SendRows (kSend) and ReturnRows are each other's transposes: each one's
// backward is the other's forward along the opposite route, and the gradient
// leaves in the dtype its input had.
template <bool kSend>
class MoveRowsFn : public torch::autograd::Function<MoveRowsFn<kSend>> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* comm,
                            const at::Tensor& members, const at::Tensor& slot,
                            const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
    const internal::RowRelation rel{members, slot};
    SaveRoute(ctx, comm, rel, send, recv);
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    return Move(kSend, *comm, x, rel, send, recv);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const BackwardProgress progress(ctx);
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    at::Tensor grad =
        Move(!kSend, *SavedComm(ctx), grads[0].to(dtype), SavedRelation(ctx),
             ctx->saved_data["recv"].toIntVector(), ctx->saved_data["send"].toIntVector());
    return {grad.to(dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }

 private:
  static at::Tensor Move(bool send_rows, Communicator& comm, const at::Tensor& x,
                         const internal::RowRelation& rel, const std::vector<int64_t>& send,
                         const std::vector<int64_t>& recv) {
    return send_rows ? RunSendRows(comm, x, rel, send, recv)
                     : RunReturnRows(comm, x, rel, send, recv);
  }
};

class AllGatherRowsFn : public torch::autograd::Function<AllGatherRowsFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* comm,
                            const std::vector<int64_t>& rows) {
    ctx->saved_data["comm"] = reinterpret_cast<int64_t>(comm);
    SaveProgress(ctx);
    ctx->saved_data["rows"] = rows;
    return RunAllGather(*comm, x, rows);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const BackwardProgress progress(ctx);
    return {RunSumKeepOwn(*SavedComm(ctx), grads[0], ctx->saved_data["rows"].toIntVector()),
            at::Tensor(), at::Tensor()};
  }
};

class SumKeepOwnRowsFn : public torch::autograd::Function<SumKeepOwnRowsFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* comm,
                            const std::vector<int64_t>& rows) {
    ctx->saved_data["comm"] = reinterpret_cast<int64_t>(comm);
    SaveProgress(ctx);
    ctx->saved_data["rows"] = rows;
    return RunSumKeepOwn(*comm, x, rows);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const BackwardProgress progress(ctx);
    return {RunAllGather(*SavedComm(ctx), grads[0], ctx->saved_data["rows"].toIntVector()),
            at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor SendRows(Communicator& comm, const at::Tensor& x, const internal::RowRelation& relation,
                    const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& recv_counts) {
  return MoveRowsFn<true>::apply(x, &comm, relation.members, relation.slot, send_counts,
                                 recv_counts);
}

at::Tensor ReturnRows(Communicator& comm, const at::Tensor& x,
                      const internal::RowRelation& relation,
                      const std::vector<int64_t>& send_counts,
                      const std::vector<int64_t>& recv_counts) {
  return MoveRowsFn<false>::apply(x, &comm, relation.members, relation.slot, send_counts,
                                  recv_counts);
}

at::Tensor AllGatherRows(Communicator& comm, const at::Tensor& x,
                         const std::vector<int64_t>& row_counts) {
  return AllGatherRowsFn::apply(x, &comm, row_counts);
}

at::Tensor SumKeepOwnRows(Communicator& comm, const at::Tensor& x,
                          const std::vector<int64_t>& row_counts) {
  return SumKeepOwnRowsFn::apply(x, &comm, row_counts);
}

}  // namespace moefit::parallel
