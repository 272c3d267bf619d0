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

// The layer and phase of the forward collective, so that a watchdog report
// from its backward (run later, maybe on autograd's thread) names them too.
void SaveProgress(AutogradContext* ctx) {
  ctx->saved_data["layer"] = CurrentLayer();
  ctx->saved_data["phase"] = reinterpret_cast<int64_t>(CurrentPhase());
}

class AllToAllRowsFn : public torch::autograd::Function<AllToAllRowsFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* comm,
                            const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
    ctx->saved_data["comm"] = reinterpret_cast<int64_t>(comm);
    SaveProgress(ctx);
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return RunAllToAll(*comm, x, send, recv);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* comm = reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt());
    const ScopedLayer layer(ctx->saved_data["layer"].toInt());
    const ScopedPhase phase(reinterpret_cast<const char*>(ctx->saved_data["phase"].toInt()),
                            /*backward=*/true);
    return {RunAllToAll(*comm, grads[0], ctx->saved_data["recv"].toIntVector(),
                        ctx->saved_data["send"].toIntVector()),
            at::Tensor(), at::Tensor(), at::Tensor()};
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
    auto* comm = reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt());
    const ScopedLayer layer(ctx->saved_data["layer"].toInt());
    const ScopedPhase phase(reinterpret_cast<const char*>(ctx->saved_data["phase"].toInt()),
                            /*backward=*/true);
    return {RunSumKeepOwn(*comm, grads[0], ctx->saved_data["rows"].toIntVector()), at::Tensor(),
            at::Tensor()};
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
    auto* comm = reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt());
    const ScopedLayer layer(ctx->saved_data["layer"].toInt());
    const ScopedPhase phase(reinterpret_cast<const char*>(ctx->saved_data["phase"].toInt()),
                            /*backward=*/true);
    return {RunAllGather(*comm, grads[0], ctx->saved_data["rows"].toIntVector()), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor AllToAllRows(Communicator& comm, const at::Tensor& x,
                        const std::vector<int64_t>& send_counts,
                        const std::vector<int64_t>& recv_counts) {
  return AllToAllRowsFn::apply(x, &comm, send_counts, recv_counts);
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
