// Activations between the dense device and the host (MoveActivations): with
// the dense layers on the CPU it is the identity, moves nothing and counts no
// bytes, forward and backward.
#include "framework/internal/host_transfer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace moefit::framework::internal {
namespace {

TEST(MoveActivations, OnTheCpuIsTheIdentity) {
  const int64_t before = PcieBytes();
  at::Tensor x = at::randn({5, 7}).requires_grad_();
  at::Tensor moved = MoveActivations(x, at::kCPU);
  EXPECT_TRUE(moved.is_same(x));
  (moved * 3).sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), at::full({5, 7}, 3.0f)));
  EXPECT_EQ(PcieBytes(), before);
}

TEST(MoveActivations, RefusesTwoDevicesWithoutTheHost) {
  // Only reachable with two non-CPU devices; here the message path is checked
  // through the meta device, which is not the host either.
  at::Tensor x = at::empty({2}, at::TensorOptions().device(c10::kMeta));
  EXPECT_THROW(MoveActivations(x, c10::Device(c10::kCUDA, 0)), c10::Error);
}

}  // namespace
}  // namespace moefit::framework::internal
