// Dense-gradient all-reduce during backward (OverlappedGradSync) against the
// after-backward sum (AllReduceSum), under mpirun -np 2: the same gradients
// bit for bit at several bucket sizes, with gradient accumulation, a
// parameter no rank gives a gradient (stays undefined), one only rank 0 gives
// a gradient (summed as if the others had zeros), one that only an earlier
// micro-batch touches, and two dtypes. Also that buckets are really posted
// during backward, in reverse parameter order. The same with the parameters
// on a GPU that both ranks share (label gpu; skipped without one).
#include "parallel/grad_sync.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <string>
#include <vector>

#include "tests/parallel/mpi_test_env.h"

namespace moefit::parallel::testing {
namespace {

enum Param { kW0, kB0, kW1, kB1, kUnused, kRank0Only, kFirstMicroOnly, kDouble, kNumParams };

std::vector<at::Tensor> MakeParams(c10::Device device = at::kCPU) {
  at::manual_seed(7);  // the same weights on every rank
  std::vector<at::Tensor> p = {
      at::randn({48, 24}), at::randn({48}), at::randn({12, 48}), at::randn({12}),
      at::randn({8, 8}),   at::randn({12}), at::randn({12}),     at::randn({5}, at::kDouble)};
  for (at::Tensor& t : p) t = t.to(device).set_requires_grad(true);
  return p;
}

// One micro-batch's backward; what it touches depends on the rank and on
// whether it is the last micro-batch.
void Backward(const std::vector<at::Tensor>& p, int rank, int micro, bool last) {
  at::manual_seed(100 + 10 * rank + micro);
  const at::Tensor x = at::randn({6, 24}).to(p[kW0].device());
  at::Tensor y = at::tanh(at::linear(x, p[kW0], p[kB0]));
  y = at::linear(y, p[kW1], p[kB1]);
  if (rank == 0) y = y * p[kRank0Only];
  if (!last) y = y + p[kFirstMicroOnly];
  at::Tensor loss = (y * y).sum() + (p[kDouble] * p[kDouble]).sum().to(at::kFloat);
  loss.backward();
}

std::vector<at::Tensor> Grads(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> g;
  for (const at::Tensor& p : params)
    g.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return g;
}

// The slow twin: backward of both micro-batches, then the after-backward sum.
// Parameters some rank has a gradient for count as zeros where another has
// none; the one no rank touches stays undefined.
std::vector<at::Tensor> Reference(int rank, c10::Device device) {
  std::vector<at::Tensor> p = MakeParams(device);
  Backward(p, rank, 0, false);
  Backward(p, rank, 1, true);
  if (!p[kRank0Only].grad().defined()) {
    p[kRank0Only].mutable_grad() = at::zeros_like(p[kRank0Only]);
  }
  std::vector<at::Tensor> grads;
  for (const at::Tensor& t : p) grads.push_back(t.grad());
  AllReduceSum(*World(), grads, {.bucket_bytes = 1 << 10});
  return Grads(p);
}

// Both runs on `device`; the communicator is MPI's (host memory).
void ExpectEqualSums(c10::Device device) {
  const int rank = World()->rank();
  const std::vector<at::Tensor> expected = Reference(rank, device);
  ASSERT_FALSE(expected[kUnused].defined());
  ASSERT_TRUE(expected[kRank0Only].defined());
  for (const int64_t bucket_bytes : {int64_t{1}, int64_t{200}, int64_t{4096}, int64_t{1} << 20}) {
    SCOPED_TRACE(::testing::Message() << "bucket_bytes " << bucket_bytes);
    std::vector<at::Tensor> p = MakeParams(device);
    absl::StatusOr<std::unique_ptr<OverlappedGradSync>> sync =
        OverlappedGradSync::Create(*World(), p, {.bucket_bytes = bucket_bytes});
    ASSERT_TRUE(sync.ok()) << sync.status();
    for (int step = 0; step < 2; ++step) {  // the buffers are reused
      for (at::Tensor& t : p) t.mutable_grad() = at::Tensor();
      Backward(p, rank, 0, false);
      (*sync)->Arm();
      Backward(p, rank, 1, true);
      (*sync)->Finish();
      const std::vector<at::Tensor> got = Grads(p);
      for (int i = 0; i < kNumParams; ++i) {
        SCOPED_TRACE(::testing::Message() << "parameter " << i << ", step " << step);
        // EXPECT, not ASSERT: the next step's buckets are collectives, and a
        // rank that returned early would leave the others waiting.
        EXPECT_EQ(got[i].defined(), expected[i].defined());
        if (got[i].defined() && expected[i].defined()) {
          EXPECT_TRUE(at::equal(got[i], expected[i]));
        }
      }
    }
    const GradSyncStats& stats = (*sync)->last_stats();
    EXPECT_GE(stats.num_buckets, 2);  // two dtypes
    if (bucket_bytes == 1) {
      EXPECT_EQ(stats.num_buckets, kNumParams);
      // Buckets in reverse parameter order: the last parameter's comes first.
      EXPECT_EQ((*sync)->bucket_params().front(), std::vector<int64_t>{kDouble});
      // The first bucket to fill (the double parameter's) goes out while
      // backward still runs, where the hooks may call MPI.
      if (device.is_cpu()) {
        EXPECT_GE(stats.num_posted_during_backward, 1);
      } else {
        EXPECT_EQ(stats.num_posted_during_backward, 0);
      }
      // The bucket of the parameter untouched by the last micro-batch can only
      // go out in Finish, and every later bucket after it.
      EXPECT_LT(stats.num_posted_during_backward, stats.num_buckets);
    }
  }
}

TEST(OverlappedGradSync, EqualsTheAfterBackwardSumBitForBit) { ExpectEqualSums(at::kCPU); }

// Parameters on a GPU shared by the ranks, summed over MPI: the hooks run on
// autograd's device thread, which may not call MPI, so they stage the buckets
// in host memory and Finish posts them.
TEST(OverlappedGradSync, GpuParametersOverMpiEqualTheAfterBackwardSum) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  ExpectEqualSums(c10::Device(c10::kCUDA, 0));
}

TEST(OverlappedGradSync, FinishWithoutArmFails) {
  std::vector<at::Tensor> p = MakeParams();
  absl::StatusOr<std::unique_ptr<OverlappedGradSync>> sync =
      OverlappedGradSync::Create(*World(), p);
  ASSERT_TRUE(sync.ok()) << sync.status();
  EXPECT_THROW((*sync)->Finish(), c10::Error);
}

}  // namespace
}  // namespace moefit::parallel::testing
