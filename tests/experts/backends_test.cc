// Every expert backend against the eager reference (forward and backward), and
// the eager backend's own backward against finite differences in double.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <memory>

#include "experts/expert_function.h"
#include "experts/expert_problem.h"
#include "experts/registry.h"

namespace moefit::experts {
namespace {

std::unique_ptr<ExpertBackend> Backend(const std::string& name) {
  auto b = CreateExpertBackend(name, {.num_threads = 2});
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(*b);
}

// Max |a - b| / max(|b|) over the tensor: a relative error robust to zeros.
double RelErr(const at::Tensor& a, const at::Tensor& b) {
  const double scale = b.abs().max().item<double>();
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() /
         (scale > 0 ? scale : 1.0);
}

const std::vector<ExpertProblemShape>& Cases() {
  static const std::vector<ExpertProblemShape> cases = {
      {"uniform", 97, 32, 24, 8, 2, RoutingPattern::kUniform},
      {"skewed", 300, 48, 40, 16, 4, RoutingPattern::kSkewed},
      {"one_expert", 64, 32, 16, 4, 2, RoutingPattern::kOneExpert},
      {"some_empty", 50, 16, 8, 7, 3, RoutingPattern::kSomeEmpty},
      {"tiny", 1, 8, 4, 3, 1, RoutingPattern::kUniform},
  };
  return cases;
}

class BackendsAgree : public ::testing::TestWithParam<std::tuple<std::string, size_t>> {};

TEST_P(BackendsAgree, ForwardAndBackwardMatchEagerInFp32) {
  const auto& [name, case_idx] = GetParam();
  const ExpertProblemShape& shape = Cases()[case_idx];
  ExpertProblem p = MakeExpertProblem(shape, at::kFloat, 1234 + case_idx);
  auto ref = Backend("eager");
  auto fast = Backend(name);
  at::Tensor act_ref, act_fast;
  at::Tensor y_ref = ref->Forward(p.x, p.counts, {p.gate_up_proj, p.down_proj}, &act_ref);
  at::Tensor y_fast = fast->Forward(p.x, p.counts, {p.gate_up_proj, p.down_proj}, &act_fast);
  EXPECT_LT(RelErr(y_fast, y_ref), 1e-5) << shape.name;
  ExpertGrads g_ref =
      ref->Backward(p.grad_y, p.x, p.counts, {p.gate_up_proj, p.down_proj}, act_ref);
  ExpertGrads g_fast =
      fast->Backward(p.grad_y, p.x, p.counts, {p.gate_up_proj, p.down_proj}, act_fast);
  EXPECT_LT(RelErr(g_fast.x, g_ref.x), 1e-5) << shape.name;
  EXPECT_LT(RelErr(g_fast.gate_up_proj, g_ref.gate_up_proj), 1e-5) << shape.name;
  EXPECT_LT(RelErr(g_fast.down_proj, g_ref.down_proj), 1e-5) << shape.name;
  // Experts that received no rows get exactly zero weight gradients.
  for (size_t e = 0; e < p.counts.size(); ++e) {
    if (p.counts[e] == 0) {
      EXPECT_EQ(g_fast.gate_up_proj[e].abs().max().item<float>(), 0.0f);
      EXPECT_EQ(g_fast.down_proj[e].abs().max().item<float>(), 0.0f);
    }
  }
}

TEST_P(BackendsAgree, Bf16CloseToFp32Reference) {
  const auto& [name, case_idx] = GetParam();
  const ExpertProblemShape& shape = Cases()[case_idx];
  ExpertProblem p32 = MakeExpertProblem(shape, at::kFloat, 99 + case_idx);
  ExpertProblem p16 = MakeExpertProblem(shape, at::kBFloat16, 99 + case_idx);
  at::Tensor act32, act16;
  at::Tensor y32 =
      Backend("eager")->Forward(p32.x, p32.counts, {p32.gate_up_proj, p32.down_proj}, &act32);
  auto fast = Backend(name);
  at::Tensor y16 = fast->Forward(p16.x, p16.counts, {p16.gate_up_proj, p16.down_proj}, &act16);
  EXPECT_EQ(y16.scalar_type(), at::kBFloat16);
  // bf16 inputs are rounded copies of the fp32 ones: a few bf16 ulps end to end.
  EXPECT_LT(RelErr(y16, y32), 3e-2) << shape.name;
  ExpertGrads g16 =
      fast->Backward(p16.grad_y, p16.x, p16.counts, {p16.gate_up_proj, p16.down_proj}, act16);
  EXPECT_EQ(g16.gate_up_proj.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::isfinite(g16.x).all().item<bool>());
}

// The same rows in 2E segments (each expert's first half of rows, for every
// expert, then the second halves: what an all-to-all from two ranks delivers)
// give the same outputs row for row and the same weight gradients.
TEST_P(BackendsAgree, SegmentedRowsMatchExpertMajorRows) {
  const auto& [name, case_idx] = GetParam();
  const ExpertProblemShape& shape = Cases()[case_idx];
  ExpertProblem p = MakeExpertProblem(shape, at::kFloat, 555 + case_idx);
  const int64_t num_experts = shape.num_experts;
  std::vector<int64_t> begin(num_experts, 0), seg_counts(2 * num_experts), perm;
  for (int64_t e = 1; e < num_experts; ++e) begin[e] = begin[e - 1] + p.counts[e - 1];
  for (int half = 0; half < 2; ++half) {
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t first = p.counts[e] / 2;
      const int64_t from = half == 0 ? 0 : first, n = half == 0 ? first : p.counts[e] - first;
      seg_counts[half * num_experts + e] = n;
      for (int64_t r = 0; r < n; ++r) perm.push_back(begin[e] + from + r);
    }
  }
  at::Tensor idx = at::tensor(perm, at::kLong);
  auto ref = Backend("eager");
  auto fast = Backend(name);
  at::Tensor act_ref, act_seg;
  at::Tensor y_ref = ref->Forward(p.x, p.counts, {p.gate_up_proj, p.down_proj}, &act_ref);
  at::Tensor x_seg = p.x.index_select(0, idx), gy_seg = p.grad_y.index_select(0, idx);
  at::Tensor y_seg = fast->Forward(x_seg, seg_counts, {p.gate_up_proj, p.down_proj}, &act_seg);
  EXPECT_LT(RelErr(y_seg, y_ref.index_select(0, idx)), 1e-5) << shape.name;
  ExpertGrads g_ref =
      ref->Backward(p.grad_y, p.x, p.counts, {p.gate_up_proj, p.down_proj}, act_ref);
  ExpertGrads g_seg =
      fast->Backward(gy_seg, x_seg, seg_counts, {p.gate_up_proj, p.down_proj}, act_seg);
  EXPECT_LT(RelErr(g_seg.x, g_ref.x.index_select(0, idx)), 1e-5) << shape.name;
  EXPECT_LT(RelErr(g_seg.gate_up_proj, g_ref.gate_up_proj), 1e-5) << shape.name;
  EXPECT_LT(RelErr(g_seg.down_proj, g_ref.down_proj), 1e-5) << shape.name;
}

INSTANTIATE_TEST_SUITE_P(All, BackendsAgree,
                         ::testing::Combine(::testing::Values("eager", "grouped"),
                                            ::testing::Range<size_t>(0, 5)));

// Central finite differences of L = sum(y * grad_y) in double precision.
class Gradcheck : public ::testing::TestWithParam<std::string> {};

TEST_P(Gradcheck, MatchesFiniteDifferences) {
  ExpertProblemShape shape{"gc", 5, 4, 3, 3, 2, RoutingPattern::kSomeEmpty};
  ExpertProblem p = MakeExpertProblem(shape, at::kDouble, 7);
  shape.pattern = RoutingPattern::kUniform;
  ExpertProblem q = MakeExpertProblem(shape, at::kDouble, 8);  // counts with every expert busy
  for (ExpertProblem* prob : {&p, &q}) {
    auto backend = Backend(GetParam());
    at::Tensor x = prob->x.clone().requires_grad_(true);
    at::Tensor gu = prob->gate_up_proj.clone().requires_grad_(true);
    at::Tensor dn = prob->down_proj.clone().requires_grad_(true);
    at::Tensor loss = (ExpertFfn(*backend, x, prob->counts, gu, dn) * prob->grad_y).sum();
    loss.backward();
    const double eps = 1e-6;
    for (at::Tensor* t : {&x, &gu, &dn}) {
      at::Tensor flat = t->detach().view({-1});
      at::Tensor analytic = t->grad().view({-1});
      for (int64_t i = 0; i < flat.numel(); ++i) {
        const double orig = flat[i].item<double>();
        auto eval = [&] {
          at::Tensor act;
          return (backend->Forward(x.detach(), prob->counts, {gu.detach(), dn.detach()}, &act) *
                  prob->grad_y)
              .sum()
              .item<double>();
        };
        flat[i] = orig + eps;
        const double plus = eval();
        flat[i] = orig - eps;
        const double minus = eval();
        flat[i] = orig;
        EXPECT_NEAR(analytic[i].item<double>(), (plus - minus) / (2 * eps), 1e-6)
            << "element " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, Gradcheck, ::testing::Values("eager", "grouped"));

TEST(Registry, UnknownBackendNamesTheKnownOnes) {
  auto b = CreateExpertBackend("fast", {});
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().message(), "unknown expert backend 'fast' (known: grouped, eager)");
}

}  // namespace
}  // namespace moefit::experts
