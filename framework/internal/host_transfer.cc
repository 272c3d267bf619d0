// Pinned, non-blocking activation copies between a GPU and the host; see
// host_transfer.h. Written against c10's device-generic stream API, so this
// file needs no CUDA headers and builds without CUDA.
#include "framework/internal/host_transfer.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>

namespace moefit::framework::internal {
namespace {

std::atomic<int64_t> pcie_bytes{0};

// The copy itself, outside autograd.
at::Tensor Copy(const at::Tensor& x, c10::Device device) {
  if (x.device() == device) return x;
  TORCH_CHECK(x.device().is_cpu() != device.is_cpu(), "MoveActivations: from ", x.device(), " to ",
              device, ": one side must be the host");
  pcie_bytes += static_cast<int64_t>(x.nbytes());
  if (device.is_cpu()) {
    at::Tensor host = at::empty(x.sizes(), x.options().device(c10::kCPU).pinned_memory(true));
    host.copy_(x, /*non_blocking=*/true);
    // The CPU reads it next: wait for the copy (and what the stream ran before it).
    c10::impl::VirtualGuardImpl(x.device().type()).getStream(x.device()).synchronize();
    return host;
  }
  at::Tensor pinned = x;
  if (!x.is_pinned()) {
    pinned = at::empty(x.sizes(), x.options().pinned_memory(true));
    pinned.copy_(x);
  }
  return pinned.to(device, /*non_blocking=*/true);
}

struct MoveFunction : torch::autograd::Function<MoveFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            c10::Device device) {
    ctx->saved_data["from"] = x.device();
    return Copy(x.contiguous(), device);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {Copy(grads[0].contiguous(), ctx->saved_data["from"].toDevice()), at::Tensor()};
  }
};

}  // namespace

at::Tensor MoveActivations(const at::Tensor& x, c10::Device device) {
  if (x.device() == device) return x;
  return MoveFunction::apply(x, device);
}

int64_t PcieBytes() { return pcie_bytes.load(); }

}  // namespace moefit::framework::internal
