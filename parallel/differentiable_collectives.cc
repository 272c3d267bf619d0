// Autograd functions over Communicator collectives; see differentiable_collectives.h.
#include "parallel/differentiable_collectives.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "parallel/internal/collective_checks.h"
#include "parallel/progress.h"

namespace moefit::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::vector<int64_t> Shape(const at::Tensor& x, int64_t rows) {
  std::vector<int64_t> s = x.sizes().vec();
  s[0] = rows;
  return s;
}

at::Tensor RunAllGather(Communicator& comm, const at::Tensor& x, const std::vector<int64_t>& rows) {
  at::Tensor in = x.contiguous();
  at::Tensor out = at::empty(Shape(in, internal::Total(rows)), in.options());
  comm.AllGatherV(in, out, rows)->WaitOrThrow();
  return out;
}

at::Tensor RunSumKeepOwn(Communicator& comm, const at::Tensor& x,
                         const std::vector<int64_t>& rows) {
  at::Tensor sum = x.contiguous().clone();
  comm.AllReduce(sum, ReduceOp::kSum)->WaitOrThrow();
  const int64_t begin = internal::BlockStart(rows, comm.rank());
  return sum.narrow(0, begin, rows[comm.rank()]).clone();
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

// What the two halves of a split row move share: the route, and the
// collective in flight with its receive buffer (the forward's, then the
// backward's).
struct RowMove final : torch::CustomClassHolder {
  Communicator* comm = nullptr;
  bool send_rows = true;  // SendRows; false: ReturnRows
  experts::kernels::RowRelation rel;
  std::vector<int64_t> send, recv;    // the forward's rows per peer
  at::ScalarType dtype = at::kFloat;  // the moved tensor's
  std::shared_ptr<Work> work;
  at::Tensor received;
  // Rows returned: this rank's own rows, which stay where they are, and
  // where they belong among the received rows (which leave a gap for them).
  at::Tensor own;
  int64_t own_at = 0;
};

c10::intrusive_ptr<RowMove> SavedMove(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<RowMove>(ctx->saved_data["move"].toCapsule());
}

// Posts x's rows along the relation: as SendRows (each member's group row
// to its rank, read where it lies) or as the first half of ReturnRows (the
// rows to the ranks, in order, to be summed into groups when received). A
// ReturnRows move sends only the other ranks' blocks, each where it lies
// (an ascending run of x's rows: AllToAllVGather sends it without a
// gather), and keeps this rank's own block for Finish to read where it
// lies: it is not copied into the received rows first.
void Post(RowMove& move, bool send_rows, const at::Tensor& x, const std::vector<int64_t>& send,
          const std::vector<int64_t>& recv) {
  const at::Tensor in = x.contiguous();
  if (send_rows) {
    move.received = at::empty(Shape(in, internal::Total(recv)), in.options());
    move.work = move.comm->AllToAllVGather(in, experts::kernels::GroupOf(move.rel), send,
                                           move.received, recv);
    return;
  }
  const int me = move.comm->rank();
  const int64_t own_begin = internal::BlockStart(send, me);
  move.own_at = internal::BlockStart(recv, me);
  move.own = in.narrow(0, own_begin, send[me]);
  std::vector<int64_t> send_others = send, recv_others = recv;
  send_others[me] = recv_others[me] = 0;
  const at::Tensor rows = at::cat(
      {at::arange(own_begin, at::kLong), at::arange(own_begin + send[me], in.size(0), at::kLong)});
  move.received = at::empty(Shape(in, internal::Total(recv_others)), in.options());
  move.work = move.comm->AllToAllVGather(in, rows, send_others, move.received, recv_others);
}

// Waits for what Post(send_rows) posted: the received rows, or their sums
// (with this rank's own rows) into the relation's groups.
at::Tensor Finish(RowMove& move, bool send_rows) {
  move.work->WaitOrThrow();
  move.work.reset();
  at::Tensor out = std::move(move.received);
  if (send_rows) return out;
  at::Tensor own = std::move(move.own);
  return experts::kernels::SumAroundBlock(out, move.own_at, own, move.rel);
}

// The first half: posts the move; its output is only the link to the second
// half. Backward: waits for the gradients' move that the second half's
// backward posted.
class StartMoveFn : public torch::autograd::Function<StartMoveFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            c10::intrusive_ptr<RowMove> move) {
    SaveProgress(ctx);
    move->dtype = x.scalar_type();
    Post(*move, move->send_rows, x, move->send, move->recv);
    ctx->saved_data["move"] = c10::IValue::make_capsule(move);
    return at::empty({0}, x.options());
  }
  static variable_list backward(AutogradContext* ctx, variable_list) {
    const BackwardProgress progress(ctx);
    const c10::intrusive_ptr<RowMove> move = SavedMove(ctx);
    return {Finish(*move, !move->send_rows).to(move->dtype), at::Tensor()};
  }
};

// The second half: waits for the move. Backward: posts the gradients along
// the opposite route, the transposed move (SendRows and ReturnRows are each
// other's transposes), in the moved tensor's dtype.
class FinishMoveFn : public torch::autograd::Function<FinishMoveFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*link*/,
                            c10::intrusive_ptr<RowMove> move) {
    SaveProgress(ctx);
    ctx->saved_data["move"] = c10::IValue::make_capsule(move);
    return Finish(*move, move->send_rows);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const BackwardProgress progress(ctx);
    const c10::intrusive_ptr<RowMove> move = SavedMove(ctx);
    Post(*move, !move->send_rows, grads[0].to(move->dtype), move->recv, move->send);
    return {at::empty({0}, grads[0].options().dtype(move->dtype)), at::Tensor()};
  }
};

RowsInFlight StartMove(bool send_rows, Communicator& comm, const at::Tensor& x,
                       const experts::kernels::RowRelation& relation,
                       const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
  auto move = c10::make_intrusive<RowMove>();
  move->comm = &comm;
  move->send_rows = send_rows;
  move->rel = relation;
  move->send = send;
  move->recv = recv;
  at::Tensor link = StartMoveFn::apply(x, move);
  return {std::move(link), std::move(move)};
}

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

RowsInFlight StartSendRows(Communicator& comm, const at::Tensor& x,
                           const experts::kernels::RowRelation& relation,
                           const std::vector<int64_t>& send_counts,
                           const std::vector<int64_t>& recv_counts) {
  return StartMove(/*send_rows=*/true, comm, x, relation, send_counts, recv_counts);
}

RowsInFlight StartReturnRows(Communicator& comm, const at::Tensor& x,
                             const experts::kernels::RowRelation& relation,
                             const std::vector<int64_t>& send_counts,
                             const std::vector<int64_t>& recv_counts) {
  return StartMove(/*send_rows=*/false, comm, x, relation, send_counts, recv_counts);
}

at::Tensor FinishRows(const RowsInFlight& rows) {
  return FinishMoveFn::apply(rows.link, c10::static_intrusive_pointer_cast<RowMove>(rows.move));
}

at::Tensor SendRows(Communicator& comm, const at::Tensor& x,
                    const experts::kernels::RowRelation& relation,
                    const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& recv_counts) {
  return FinishRows(StartSendRows(comm, x, relation, send_counts, recv_counts));
}

at::Tensor ReturnRows(Communicator& comm, const at::Tensor& x,
                      const experts::kernels::RowRelation& relation,
                      const std::vector<int64_t>& send_counts,
                      const std::vector<int64_t>& recv_counts) {
  return FinishRows(StartReturnRows(comm, x, relation, send_counts, recv_counts));
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
