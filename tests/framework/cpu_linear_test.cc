// The CPU linear map on moefit's GEMM (framework/cpu_linear.h) against
// at::linear in float64 and in float32, forward and the three gradients, on
// every instruction set this CPU runs: odd shapes, several row and feature
// blocks, one row, 3-D inputs, bias or none, no inputs or no tokens, a frozen
// weight; the same bits at one and two threads and for a token whatever else
// shares its batch.
#include "framework/cpu_linear.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "experts/kernels/isa.h"
#include "tests/framework/kernel_checks.h"

namespace moefit::framework {
namespace {

namespace kern = moefit::experts::kernels;

struct Shape {
  std::vector<int64_t> x;  // [..., K]
  int64_t n;
  bool bias;
};

struct Inputs {
  at::Tensor x, weight, bias, grad_out;
};

Inputs MakeInputs(const Shape& s, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Inputs in;
  in.x = at::randn(s.x, gen, at::kFloat);
  in.weight = at::randn({s.n, s.x.back()}, gen, at::kFloat) * 0.1;
  if (s.bias) in.bias = at::randn({s.n}, gen, at::kFloat);
  std::vector<int64_t> out = s.x;
  out.back() = s.n;
  in.grad_out = at::randn(out, gen, at::kFloat);
  return in;
}

struct Result {
  at::Tensor y, dx, dw, db;
};

template <typename F>
Result RunLinear(const Inputs& in, at::ScalarType dtype, bool train_weight, F linear) {
  const at::Tensor x = in.x.to(dtype).clone().requires_grad_(true);
  const at::Tensor w = in.weight.to(dtype).clone().requires_grad_(train_weight);
  const at::Tensor b =
      in.bias.defined() ? in.bias.to(dtype).clone().requires_grad_(true) : at::Tensor();
  at::Tensor y = linear(x, w, b);
  y.backward(in.grad_out.to(dtype));
  return {y.detach(), x.grad(), w.grad(), b.defined() ? b.grad() : at::Tensor()};
}

void ExpectClose(const Result& got, const Result& want, double tol, const std::string& what) {
  EXPECT_LT(RelativeError(got.y, want.y), tol) << what << ": y";
  EXPECT_LT(RelativeError(got.dx, want.dx), tol) << what << ": dx";
  ASSERT_EQ(got.dw.defined(), want.dw.defined()) << what;
  if (want.dw.defined()) {
    EXPECT_LT(RelativeError(got.dw, want.dw), tol) << what << ": dw";
  }
  ASSERT_EQ(got.db.defined(), want.db.defined()) << what;
  if (want.db.defined()) {
    EXPECT_LT(RelativeError(got.db, want.db), tol) << what << ": db";
  }
}

at::Tensor Ours(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return CpuLinear(x, w, b);
}
at::Tensor Theirs(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return at::linear(x, w, b);
}

class CpuLinearShapes : public ::testing::TestWithParam<Shape> {};

TEST_P(CpuLinearShapes, MatchesAtLinearOnEveryInstructionSet) {
  const Shape s = GetParam();
  const Inputs in = MakeInputs(s, 21);
  ASSERT_TRUE(CpuLinearApplies(in.x, in.weight, in.bias));
  const FullIsaAfter restore;
  for (bool train_weight : {true, false}) {
    const Result want = RunLinear(in, at::kDouble, train_weight, Theirs);
    const Result libtorch = RunLinear(in, at::kFloat, train_weight, Theirs);
    ExpectClose(libtorch, want, 1e-5, "at::linear");
    for (int i = static_cast<int>(kern::DetectIsa()); i >= 0; --i) {
      const kern::Isa isa = static_cast<kern::Isa>(i);
      kern::LimitIsa(isa);
      const std::string what =
          std::string(kern::IsaName(isa)) + (train_weight ? "" : " frozen weight");
      const Result got = RunLinear(in, at::kFloat, train_weight, Ours);
      ExpectClose(got, want, 1e-5, what + " vs float64");
      ExpectClose(got, libtorch, 1e-5, what + " vs at::linear");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, CpuLinearShapes,
                         ::testing::Values(Shape{{1, 8}, 5, true},           // one row
                                           Shape{{37, 29}, 13, true},        // odd
                                           Shape{{2, 300, 64}, 130, false},  // 3-D, blocks
                                           Shape{{600, 48}, 200, true},      // blocks, bias
                                           Shape{{7, 3, 0}, 6, true},        // K = 0
                                           Shape{{0, 8}, 5, true}));         // no tokens

TEST(CpuLinear, SameBitsAtOneAndTwoThreads) {
  const Inputs in = MakeInputs({{700, 96}, 150, true}, 4);
  auto run = [&](int threads) {
    return AtThreads(threads, [&] { return RunLinear(in, at::kFloat, true, Ours); });
  };
  const Result one = run(1), two = run(2);
  EXPECT_TRUE(at::equal(one.y, two.y));
  EXPECT_TRUE(at::equal(one.dx, two.dx));
  EXPECT_TRUE(at::equal(one.dw, two.dw));
  EXPECT_TRUE(at::equal(one.db, two.db));
}

// Data parallelism splits a batch over ranks: each token's output and input
// gradient must be the same bits whatever else shares its batch.
TEST(CpuLinear, EachTokenGivesTheSameBitsInAnyBatch) {
  const Inputs in = MakeInputs({{530, 72}, 90, true}, 6);
  const Result all = RunLinear(in, at::kFloat, true, Ours);
  for (const auto& [from, rows] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {3, 5}, {200, 330}}) {
    Inputs part = in;
    part.x = in.x.narrow(0, from, rows);
    part.grad_out = in.grad_out.narrow(0, from, rows);
    const Result r = RunLinear(part, at::kFloat, true, Ours);
    EXPECT_TRUE(at::equal(r.y, all.y.narrow(0, from, rows))) << from;
    EXPECT_TRUE(at::equal(r.dx, all.dx.narrow(0, from, rows))) << from;
  }
}

TEST(CpuLinear, RefusesWhatItDoesNotCompute) {
  const Inputs in = MakeInputs({{4, 6}, 3, true}, 8);
  EXPECT_FALSE(CpuLinearApplies(in.x.to(at::kDouble), in.weight, in.bias));
  EXPECT_FALSE(CpuLinearApplies(in.x, in.weight.narrow(1, 0, 5), in.bias));
  EXPECT_FALSE(CpuLinearApplies(in.x, in.weight, in.bias.narrow(0, 0, 2)));
  EXPECT_THROW(CpuLinear(in.x, in.weight.narrow(1, 0, 5)), c10::Error);
}

}  // namespace
}  // namespace moefit::framework
