// The caching host allocator: large tensors reuse freed blocks of their size
// class, small ones are left to the default allocator, contents are the
// tensors' own, switching back leaves earlier tensors valid, and LibTorch's
// raw allocations (oneDNN's scratch memory) go through it and back.
#include "framework/host_allocator.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <cstring>

namespace moefit::framework {
namespace {

class HostAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override { UseCachingHostAllocator(true); }
  void TearDown() override { UseCachingHostAllocator(false); }
};

TEST_F(HostAllocatorTest, ReusesFreedBlocksOfTheSameSizeClass) {
  const HostAllocatorStats before = GetHostAllocatorStats();
  const void* first = nullptr;
  {
    at::Tensor a = at::empty({3 << 20}, at::kFloat);  // 12 MiB
    first = a.data_ptr();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % (2 << 20), 0u);  // huge-page aligned
  }
  EXPECT_GE(GetHostAllocatorStats().cached_bytes, 12 << 20);
  at::Tensor b = at::empty({(3 << 20) - 1000}, at::kFloat);  // same 12 MiB class
  EXPECT_EQ(b.data_ptr(), first);
  at::Tensor c = at::empty({5 << 20}, at::kFloat);  // 20 MiB: another class
  EXPECT_NE(c.data_ptr(), first);
  const HostAllocatorStats after = GetHostAllocatorStats();
  EXPECT_EQ(after.allocations - before.allocations, 3);
  EXPECT_EQ(after.reused - before.reused, 1);
}

TEST_F(HostAllocatorTest, SmallTensorsBypassTheCache) {
  const HostAllocatorStats before = GetHostAllocatorStats();
  { at::Tensor small = at::ones({1000}, at::kFloat); }
  EXPECT_EQ(GetHostAllocatorStats().allocations, before.allocations);
}

TEST_F(HostAllocatorTest, TensorsKeepTheirValuesAcrossReuseAndSwitching) {
  at::Tensor keep = at::arange(4 << 20, at::kFloat);  // 16 MiB, made by the cache
  const void* scratch_block = nullptr;
  {
    at::Tensor scratch = at::full({4 << 20}, 7.0f);
    scratch_block = scratch.data_ptr();
  }
  at::Tensor reuse = at::zeros({4 << 20}, at::kFloat);  // the scratch block, cleared
  EXPECT_EQ(reuse.data_ptr(), scratch_block);
  EXPECT_EQ(reuse.abs().sum().item<double>(), 0.0);
  UseCachingHostAllocator(false);
  at::Tensor plain = at::arange(4 << 20, at::kFloat);
  EXPECT_TRUE(at::equal(keep, plain));
  const void* keep_block = keep.data_ptr();
  keep = at::Tensor();  // freed into the cache after switching: still fine
  reuse = at::Tensor();
  UseCachingHostAllocator(true);
  at::Tensor again = at::ones({4 << 20}, at::kFloat);
  EXPECT_TRUE(again.data_ptr() == keep_block || again.data_ptr() == scratch_block);
  EXPECT_EQ(again.sum().item<double>(), static_cast<double>(4 << 20));
}

TEST_F(HostAllocatorTest, RawAllocationsOfEverySizeComeBack) {
  c10::Allocator* allocator = c10::GetCPUAllocator();
  const HostAllocatorStats before = GetHostAllocatorStats();
  for (const size_t n : {size_t{64}, size_t{3} << 20}) {
    void* p = allocator->raw_allocate(n);
    ASSERT_NE(p, nullptr);
    std::memset(p, 1, n);
    allocator->raw_deallocate(p);
  }
  // The large one went back to the cache, and is handed out again.
  EXPECT_EQ(GetHostAllocatorStats().allocations - before.allocations, 1);
  EXPECT_GE(GetHostAllocatorStats().cached_bytes, 4 << 20);
  void* again = allocator->raw_allocate(size_t{3} << 20);
  EXPECT_EQ(GetHostAllocatorStats().reused - before.reused, 1);
  // Given back after the cache is switched off (as oneDNN may, looking the
  // allocator up again): it still returns to the cache, once.
  UseCachingHostAllocator(false);
  c10::GetCPUAllocator()->raw_deallocate(again);
  void* plain = c10::GetCPUAllocator()->raw_allocate(size_t{3} << 20);
  EXPECT_NE(plain, again);
  c10::GetCPUAllocator()->raw_deallocate(plain);
  UseCachingHostAllocator(true);
  void* cached = allocator->raw_allocate(size_t{3} << 20);
  EXPECT_EQ(cached, again);
  allocator->raw_deallocate(cached);
  // A bfloat16 product, which takes oneDNN's path (and its raw scratch).
  const at::Tensor a = at::randn({256, 512}).to(at::kBFloat16);
  const at::Tensor b = at::randn({512, 768}).to(at::kBFloat16);
  const at::Tensor want = at::matmul(a.to(at::kFloat), b.to(at::kFloat));
  EXPECT_LT((at::matmul(a, b).to(at::kFloat) - want).abs().max().item<float>(),
            0.02 * want.abs().max().item<float>());
}

}  // namespace
}  // namespace moefit::framework
