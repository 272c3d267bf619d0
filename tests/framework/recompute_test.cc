// Activation recomputation against the plain run: outputs and gradients of a
// two-layer block with captured parameters and dropout equal bitwise (float32
// and float64, draws made between forward and backward neither seen nor
// consumed by the recomputation); several outputs (one unused, a side loss,
// an integer one, an undefined one); captured parameters with no input
// requiring grad (integer positions passed through); nesting; one run under
// no-grad; central differences in float64; and the refused uses.
#include "framework/recompute.h"
#include "tests/framework/test_configs.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace moefit::framework {
namespace {

constexpr double kDropout = 0.3;

// Leaves with requires_grad, captured by the functions under test.
struct Weights {
  at::Tensor w1, b1, w2, w3;
};

Weights MakeWeights(at::TensorOptions options, int64_t in = 6, int64_t hidden = 10,
                    int64_t out = 4) {
  Weights w;
  w.w1 = (at::randn({hidden, in}, options) * 0.4).requires_grad_();
  w.b1 = (at::randn({hidden}, options) * 0.1).requires_grad_();
  w.w2 = (at::randn({out, hidden}, options) * 0.4).requires_grad_();
  w.w3 = (at::randn({out, out}, options) * 0.4).requires_grad_();
  return w;
}

// tanh(dropout(silu(x·w1ᵀ + b1))·w2ᵀ); `dropout` false for the
// finite-difference check.
at::Tensor TwoLayer(const Weights& w, const at::Tensor& x, bool dropout = true) {
  at::Tensor h = at::silu(at::linear(x, w.w1, w.b1));
  if (dropout) h = at::dropout(h, kDropout, /*train=*/true);
  return at::tanh(at::linear(h, w.w2));
}

void ExpectBitwiseEqual(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << "tensor " << i;
    if (a[i].defined()) {
      EXPECT_TRUE(at::equal(a[i], b[i])) << "tensor " << i;
    }
  }
}

// What one run yields (outputs, gradients, draws) and how often fn ran.
struct RunResult {
  std::vector<at::Tensor> values;
  int calls = 0;
};

// The two-layer block on tensors of `options`, recomputed and plain: output,
// gradients, and draws from the CPU and the tensors' generator made between
// forward and backward (the recomputation must not shift its masks by them)
// and after the backward (it must not consume draws) are bitwise equal.
void ExpectRecomputedMatchesPlain(at::TensorOptions options) {
  auto run = [&](bool recompute) {
    RunResult r;
    at::manual_seed(11);
    Weights w = MakeWeights(options);
    at::Tensor x = at::randn({5, 6}, options).requires_grad_();
    auto fn = [&](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
      ++r.calls;
      return {TwoLayer(w, in[0])};
    };
    at::Tensor y = recompute ? Recomputed(fn, {x})[0] : fn({x})[0];
    at::Tensor between = at::rand({7}, options), between_cpu = at::rand({7});
    at::Tensor probe = at::randn_like(y);
    (y * probe).sum().backward();
    at::Tensor after = at::rand({7}, options), after_cpu = at::rand({7});
    r.values = {y.detach(), x.grad(),    w.w1.grad(), w.b1.grad(), w.w2.grad(),
                between,    between_cpu, after,       after_cpu};
    return r;
  };
  const RunResult plain = run(false), recomputed = run(true);
  EXPECT_EQ(plain.calls, 1);
  EXPECT_EQ(recomputed.calls, 2);
  ExpectBitwiseEqual(recomputed.values, plain.values);
  // The comparison above means something only if the output depends on the
  // dropout masks: two unseeded runs differ.
  Weights w = MakeWeights(options);
  at::Tensor x = at::randn({5, 6}, options);
  at::NoGradGuard no_grad;
  EXPECT_FALSE(at::equal(TwoLayer(w, x), TwoLayer(w, x)));
}

class RecomputeDtype : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(RecomputeDtype, MatchesPlainRunBitwise) { ExpectRecomputedMatchesPlain(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Dtypes, RecomputeDtype, ::testing::Values(at::kFloat, at::kDouble),
                         [](const auto& info) {
                           return std::string(info.param == at::kFloat ? "Float32" : "Float64");
                         });

// On a GPU the CUDA generator of the inputs' device is saved and restored too.
TEST(Recompute, CudaMatchesPlainRunBitwise) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  ExpectRecomputedMatchesPlain(at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, 0));
}

// fn returns {main, unused, side loss, argmax (int64), undefined}; the loss
// uses main and the side loss only. An undefined input passes through.
TEST(Recompute, SeveralOutputsAndSideLoss) {
  auto run = [&](bool recompute) {
    RunResult r;
    at::manual_seed(5);
    Weights w = MakeWeights(at::kFloat);
    at::Tensor x = at::randn({5, 6}).requires_grad_();
    auto fn = [&](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
      EXPECT_FALSE(in[1].defined());
      at::Tensor y = TwoLayer(w, in[0]);
      at::Tensor unused = at::linear(y, w.w3);
      at::Tensor side = y.pow(2).mean();  // an auxiliary loss
      return {y, unused, side, y.argmax(-1), at::Tensor()};
    };
    std::vector<at::Tensor> out = recompute ? Recomputed(fn, {x, at::Tensor()}) : fn({x, {}});
    EXPECT_EQ(out.size(), 5u);
    EXPECT_TRUE(out[1].requires_grad());
    EXPECT_EQ(out[3].scalar_type(), at::kLong);
    EXPECT_FALSE(out[3].requires_grad());
    EXPECT_FALSE(out[4].defined());
    at::Tensor probe = at::randn_like(out[0]);
    ((out[0] * probe).sum() + 0.01 * out[2]).backward();
    r.values = {out[0].detach(), out[2].detach(), out[3],      x.grad(),
                w.w1.grad(),     w.b1.grad(),     w.w2.grad(), w.w3.grad()};
    return r;
  };
  const RunResult plain = run(false), recomputed = run(true);
  EXPECT_FALSE(recomputed.values.back().defined());  // w3 feeds only the unused output
  ExpectBitwiseEqual(recomputed.values, plain.values);
}

// No input requires grad (x is data, positions are int64): the captured
// parameters still get their gradients through the recomputation.
TEST(Recompute, CapturedParametersOnly) {
  auto run = [&](bool recompute) {
    RunResult r;
    at::manual_seed(3);
    Weights w = MakeWeights(at::kFloat);
    at::Tensor table = (at::randn({8, 6}) * 0.1).requires_grad_();  // position embeddings
    at::Tensor x = at::randn({5, 6});
    at::Tensor positions = at::arange(5, at::kLong);
    auto fn = [&](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
      ++r.calls;
      EXPECT_FALSE(in[0].requires_grad());
      EXPECT_FALSE(in[1].requires_grad());
      EXPECT_EQ(in[1].scalar_type(), at::kLong);
      return {TwoLayer(w, in[0] + table.index_select(0, in[1]))};
    };
    at::Tensor y = recompute ? Recomputed(fn, {x, positions})[0] : fn({x, positions})[0];
    EXPECT_TRUE(y.requires_grad());
    at::Tensor probe = at::randn_like(y);
    (y * probe).sum().backward();
    EXPECT_FALSE(x.grad().defined());
    r.values = {y.detach(), table.grad(), w.w1.grad(), w.b1.grad(), w.w2.grad()};
    return r;
  };
  const RunResult plain = run(false), recomputed = run(true);
  EXPECT_EQ(recomputed.calls, 2);
  ExpectBitwiseEqual(recomputed.values, plain.values);
}

// A recomputed block inside a recomputed block, each with its dropout.
TEST(Recompute, Nested) {
  auto run = [&](bool recompute) {
    RunResult r;
    int inner_calls = 0;
    at::manual_seed(9);
    Weights a = MakeWeights(at::kDouble, 6, 8, 6), b = MakeWeights(at::kDouble, 6, 10, 3);
    at::Tensor x = at::randn({4, 6}, at::kDouble).requires_grad_();
    auto inner = [&](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
      ++inner_calls;
      return {TwoLayer(a, in[0]) + in[0]};
    };
    auto outer = [&](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
      ++r.calls;
      at::Tensor h = recompute ? Recomputed(inner, in)[0] : inner(in)[0];
      return {TwoLayer(b, h)};
    };
    at::Tensor y = recompute ? Recomputed(outer, {x})[0] : outer({x})[0];
    at::Tensor probe = at::randn_like(y);
    (y * probe).sum().backward();
    r.values = {y.detach(),  x.grad(),    a.w1.grad(), a.b1.grad(),
                a.w2.grad(), b.w1.grad(), b.b1.grad(), b.w2.grad()};
    // Outer: forward, recomputation. Inner: once in the outer forward (no
    // grad), once in the outer recomputation, once in its own recomputation.
    EXPECT_EQ(inner_calls, recompute ? 3 : 1);
    return r;
  };
  const RunResult plain = run(false), recomputed = run(true);
  EXPECT_EQ(recomputed.calls, 2);
  ExpectBitwiseEqual(recomputed.values, plain.values);
}

TEST(Recompute, NoGradRunsOnce) {
  at::manual_seed(2);
  Weights w = MakeWeights(at::kFloat);
  at::Tensor x = at::randn({5, 6}).requires_grad_();
  int calls = 0;
  auto fn = [&](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
    ++calls;
    return {TwoLayer(w, in[0], /*dropout=*/false)};
  };
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> out = Recomputed(fn, {x});
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(out[0].requires_grad());
  EXPECT_TRUE(at::equal(out[0], TwoLayer(w, x, false)));
}

// d(loss)/d(t) of x and the captured weights against central differences,
// loss = sum(probe ⊙ y) + side loss, through Recomputed.
TEST(Recompute, GradientMatchesCentralDifferences) {
  at::manual_seed(4);
  Weights w = MakeWeights(at::kDouble, 3, 4, 2);
  at::Tensor x = at::randn({3, 3}, at::kDouble).requires_grad_();
  at::Tensor probe = at::randn({3, 2}, at::kDouble);
  auto fn = [&](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
    at::Tensor y = TwoLayer(w, in[0], /*dropout=*/false);
    return {y, y.pow(2).sum()};
  };
  auto loss = [&] {
    std::vector<at::Tensor> out = Recomputed(fn, {x});
    return (out[0] * probe).sum() + 0.5 * out[1];
  };
  loss().backward();
  for (const at::Tensor& t : {x, w.w1, w.b1, w.w2}) {
    EXPECT_LT(WorstCentralDifference(t, loss), 1e-7);
  }
}

// The message of what `f` throws ("" if nothing).
std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(Recompute, RefusesGradAndDoubleBackward) {
  Weights w = MakeWeights(at::kFloat);
  at::Tensor x = at::randn({5, 6}).requires_grad_();
  auto loss = [&] {
    auto fn = [&](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
      return {TwoLayer(w, in[0], /*dropout=*/false)};
    };
    return Recomputed(fn, {x})[0].sum();
  };
  EXPECT_NE(ErrorOf([&] {
              torch::autograd::grad({loss()}, {x}, {}, std::nullopt, /*create_graph=*/true);
            }).find("double backward (create_graph=true) is not supported"),
            std::string::npos);
  const std::string refused = "not from torch::autograd::grad or backward(inputs=...)";
  EXPECT_NE(ErrorOf([&] { torch::autograd::grad({loss()}, {x}); }).find(refused),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] {
              torch::autograd::backward({loss()}, {}, std::nullopt, false, {x});
            }).find(refused),
            std::string::npos);
}

TEST(Recompute, RefusesInPlaceChangeOfAnInput) {
  at::Tensor x = at::randn({3});
  auto fn = [](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
    in[0].mul_(2);
    return {in[0] * 3};
  };
  EXPECT_NE(ErrorOf([&] { Recomputed(fn, {x}); }).find("fn modified its input 0 in place"),
            std::string::npos);
}

}  // namespace
}  // namespace moefit::framework
