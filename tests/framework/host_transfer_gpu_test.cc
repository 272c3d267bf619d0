// MoveActivations with a GPU (label gpu; skips where LibTorch sees none):
// the pinned, non-blocking copies give bitwise the values and gradients of
// plain blocking .to() copies (the slow twin) and count every byte both
// ways; the host copy is pinned and complete when the CPU reads it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "framework/internal/host_transfer.h"

namespace moefit::framework::internal {
namespace {

TEST(MoveActivationsGpu, EqualsBlockingCopiesAndCountsBytes) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  const c10::Device gpu(c10::kCUDA, 0);
  at::manual_seed(3);
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor source = at::randn({257, 96}).to(gpu);
    const at::Tensor weight = at::randn({257, 96});
    auto run = [&](bool fast, at::Tensor* grad) {
      at::Tensor x = source.clone().requires_grad_();
      at::Tensor host = fast ? MoveActivations(x.to(dtype), at::kCPU) : x.to(dtype).to(at::kCPU);
      at::Tensor y = (host.to(at::kFloat) * weight).to(dtype);
      at::Tensor back = fast ? MoveActivations(y, gpu) : y.to(gpu);
      back.to(at::kFloat).square().sum().backward();
      *grad = x.grad().cpu();
      return back.cpu();
    };
    at::Tensor slow_grad, fast_grad;
    const at::Tensor slow = run(false, &slow_grad);
    const int64_t before = PcieBytes();
    const at::Tensor fast = run(true, &fast_grad);
    EXPECT_TRUE(at::equal(fast, slow)) << dtype;
    EXPECT_TRUE(at::equal(fast_grad, slow_grad)) << dtype;
    // Rows to the host and back, and their gradients back and forth.
    EXPECT_EQ(PcieBytes() - before, 4 * 257 * 96 * c10::elementSize(dtype)) << dtype;
  }
}

TEST(MoveActivationsGpu, HostCopyIsPinnedAndComplete) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  const c10::Device gpu(c10::kCUDA, 0);
  for (int i = 0; i < 20; ++i) {
    const at::Tensor x = at::full({1024, 256}, static_cast<float>(i), at::TensorOptions(gpu));
    const at::Tensor host = MoveActivations(x * 2, at::kCPU);
    ASSERT_TRUE(host.is_pinned());
    // Read at once by the CPU: the non-blocking copy must have finished.
    EXPECT_EQ(host.min().item<float>(), 2.0f * i);
    EXPECT_EQ(host.max().item<float>(), 2.0f * i);
  }
}

}  // namespace
}  // namespace moefit::framework::internal
