// Every expert backend against the eager reference (forward and backward, with
// and without LoRA adapters, frozen or trained base, saved or recomputed
// activations), and the backward passes against finite differences in double.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "experts/expert_function.h"
#include "tests/support/expert_problem.h"
#include "experts/int4.h"
#include "experts/kernels/gemm.h"
#include "experts/kernels/internal/bf16_pairs.h"
#include "experts/kernels/isa.h"
#include "experts/kernels/swiglu.h"
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

// The LoRA variants checked: both adapters, gate/up only, down only.
const std::vector<LoraSpec>& LoraSpecs() {
  static const std::vector<LoraSpec> specs = {
      {.rank = 4, .gate_up = true, .down = true, .scaling = 2.0},
      {.rank = 3, .gate_up = true, .down = false, .scaling = 0.5},
      {.rank = 5, .gate_up = false, .down = true, .scaling = 1.0},
  };
  return specs;
}

ExpertWeights Weights(const ExpertProblem& p, const ExpertLora& lora = {}) {
  return {p.gate_up_proj, p.down_proj, lora};
}

// The LoRA gradients of `a` and `b` are defined for the same adapters and
// agree to `tol` (RelErr).
void ExpectLoraGradsNear(const ExpertGrads& a, const ExpertGrads& b, double tol,
                         const std::string& what) {
  const std::vector<std::pair<const char*, std::pair<at::Tensor, at::Tensor>>> pairs = {
      {"gate_up_a", {a.gate_up_a, b.gate_up_a}},
      {"gate_up_b", {a.gate_up_b, b.gate_up_b}},
      {"down_a", {a.down_a, b.down_a}},
      {"down_b", {a.down_b, b.down_b}}};
  for (const auto& [name, t] : pairs) {
    ASSERT_EQ(t.first.defined(), t.second.defined()) << what << " " << name;
    if (t.first.defined()) {
      EXPECT_LT(RelErr(t.first, t.second), tol) << what << " " << name;
    }
  }
}

// Every defined gradient of `a` equals the one of `b` bit for bit.
void ExpectGradsEqual(const ExpertGrads& a, const ExpertGrads& b, const std::string& what) {
  const std::vector<std::pair<const char*, std::pair<at::Tensor, at::Tensor>>> pairs = {
      {"x", {a.x, b.x}},
      {"gate_up_proj", {a.gate_up_proj, b.gate_up_proj}},
      {"down_proj", {a.down_proj, b.down_proj}},
      {"gate_up_a", {a.gate_up_a, b.gate_up_a}},
      {"gate_up_b", {a.gate_up_b, b.gate_up_b}},
      {"down_a", {a.down_a, b.down_a}},
      {"down_b", {a.down_b, b.down_b}}};
  for (const auto& [name, t] : pairs) {
    ASSERT_EQ(t.first.defined(), t.second.defined()) << what << " " << name;
    if (t.first.defined()) {
      EXPECT_TRUE(at::equal(t.first, t.second)) << what << " " << name;
    }
  }
}

std::string SpecName(const ExpertProblemShape& shape, const LoraSpec& spec) {
  return shape.name + (spec.gate_up ? " gate_up" : "") + (spec.down ? " down" : "");
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
  // The grouped backend sums a bfloat16 base's weight gradients in float32
  // (for its float32 masters); the eager reference keeps the weights' dtype.
  EXPECT_EQ(g16.gate_up_proj.scalar_type(), name == "grouped" ? at::kFloat : at::kBFloat16);
  EXPECT_TRUE(at::isfinite(g16.x).all().item<bool>());
}

// The same rows in 2E segments (each expert's first half of rows, for every
// expert, then the second halves: what an all-to-all from two ranks delivers)
// give the same outputs row for row and the same weight gradients, with and
// without LoRA adapters.
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
  at::Tensor x_seg = p.x.index_select(0, idx), gy_seg = p.grad_y.index_select(0, idx);
  const LoraSpec spec{.rank = 3};
  for (const ExpertLora& lora : {ExpertLora{}, MakeExpertLora(shape, spec, at::kFloat, 556)}) {
    const std::string what = shape.name + (lora.any() ? " lora" : "");
    const ExpertWeights w{p.gate_up_proj, p.down_proj, lora};
    at::Tensor act_ref, act_seg;
    at::Tensor y_ref = ref->Forward(p.x, p.counts, w, &act_ref);
    at::Tensor y_seg = fast->Forward(x_seg, seg_counts, w, &act_seg);
    EXPECT_LT(RelErr(y_seg, y_ref.index_select(0, idx)), 1e-5) << what;
    ExpertGrads g_ref = ref->Backward(p.grad_y, p.x, p.counts, w, act_ref);
    ExpertGrads g_seg = fast->Backward(gy_seg, x_seg, seg_counts, w, act_seg);
    EXPECT_LT(RelErr(g_seg.x, g_ref.x.index_select(0, idx)), 1e-5) << what;
    EXPECT_LT(RelErr(g_seg.gate_up_proj, g_ref.gate_up_proj), 1e-5) << what;
    EXPECT_LT(RelErr(g_seg.down_proj, g_ref.down_proj), 1e-5) << what;
    ExpectLoraGradsNear(g_seg, g_ref, 1e-5, what);
  }
}

TEST_P(BackendsAgree, LoraMatchesEagerInFp32) {
  const auto& [name, case_idx] = GetParam();
  const ExpertProblemShape& shape = Cases()[case_idx];
  ExpertProblem p = MakeExpertProblem(shape, at::kFloat, 321 + case_idx);
  auto ref = Backend("eager");
  auto fast = Backend(name);
  for (const LoraSpec& spec : LoraSpecs()) {
    const std::string what = SpecName(shape, spec);
    const ExpertWeights w = Weights(p, MakeExpertLora(shape, spec, at::kFloat, 77 + case_idx));
    at::Tensor act_ref, act_fast;
    at::Tensor y_ref = ref->Forward(p.x, p.counts, w, &act_ref);
    at::Tensor y_fast = fast->Forward(p.x, p.counts, w, &act_fast);
    EXPECT_LT(RelErr(y_fast, y_ref), 1e-5) << what;
    EXPECT_LT(RelErr(act_fast, act_ref), 1e-5) << what;
    ExpertGrads g_ref = ref->Backward(p.grad_y, p.x, p.counts, w, act_ref);
    ExpertGrads g_fast = fast->Backward(p.grad_y, p.x, p.counts, w, act_fast);
    EXPECT_LT(RelErr(g_fast.x, g_ref.x), 1e-5) << what;
    EXPECT_LT(RelErr(g_fast.gate_up_proj, g_ref.gate_up_proj), 1e-5) << what;
    EXPECT_LT(RelErr(g_fast.down_proj, g_ref.down_proj), 1e-5) << what;
    ExpectLoraGradsNear(g_fast, g_ref, 1e-5, what);
    EXPECT_EQ(g_fast.gate_up_a.defined(), spec.gate_up) << what;
    EXPECT_EQ(g_fast.down_b.defined(), spec.down) << what;
    // Experts that received no rows get exactly zero LoRA gradients.
    for (size_t e = 0; e < p.counts.size(); ++e) {
      if (p.counts[e] != 0) continue;
      for (const at::Tensor& t :
           {g_fast.gate_up_a, g_fast.gate_up_b, g_fast.down_a, g_fast.down_b}) {
        if (t.defined()) {
          EXPECT_EQ(t[e].abs().max().item<float>(), 0.0f) << what;
        }
      }
    }
  }
}

// Weights wider than the grouped backend's 512-row weight-gradient blocks: the
// base and LoRA gradients are assembled from several blocks per expert.
TEST(GroupedLora, WideWeightsSplitIntoBlocks) {
  const ExpertProblemShape shape{"wide", 40, 600, 300, 3, 2, RoutingPattern::kSkewed};
  ExpertProblem p = MakeExpertProblem(shape, at::kFloat, 61);
  const ExpertWeights w = Weights(p, MakeExpertLora(shape, {.rank = 6}, at::kFloat, 62));
  auto ref = Backend("eager");
  auto fast = Backend("grouped");
  at::Tensor act_ref, act_fast;
  ref->Forward(p.x, p.counts, w, &act_ref);
  fast->Forward(p.x, p.counts, w, &act_fast);
  ExpertGrads g_ref = ref->Backward(p.grad_y, p.x, p.counts, w, act_ref);
  ExpertGrads g_fast = fast->Backward(p.grad_y, p.x, p.counts, w, act_fast);
  EXPECT_LT(RelErr(g_fast.x, g_ref.x), 1e-5);
  EXPECT_LT(RelErr(g_fast.gate_up_proj, g_ref.gate_up_proj), 1e-5);
  EXPECT_LT(RelErr(g_fast.down_proj, g_ref.down_proj), 1e-5);
  ExpectLoraGradsNear(g_fast, g_ref, 1e-5, shape.name);
}

// A bfloat16 base with float32 adapters: the LoRA branch runs in fp32, the
// outputs and dx are bfloat16, the LoRA gradients float32 and close to the
// all-fp32 reference.
TEST_P(BackendsAgree, LoraOnBf16BaseCloseToFp32Reference) {
  const auto& [name, case_idx] = GetParam();
  const ExpertProblemShape& shape = Cases()[case_idx];
  ExpertProblem p32 = MakeExpertProblem(shape, at::kFloat, 41 + case_idx);
  ExpertProblem p16 = MakeExpertProblem(shape, at::kBFloat16, 41 + case_idx);
  auto ref = Backend("eager");
  auto fast = Backend(name);
  for (const LoraSpec& spec : LoraSpecs()) {
    const std::string what = SpecName(shape, spec);
    const ExpertLora lora = MakeExpertLora(shape, spec, at::kFloat, 5 + case_idx);
    at::Tensor act32, act16;
    at::Tensor y32 = ref->Forward(p32.x, p32.counts, Weights(p32, lora), &act32);
    at::Tensor y16 = fast->Forward(p16.x, p16.counts, Weights(p16, lora), &act16);
    EXPECT_EQ(y16.scalar_type(), at::kBFloat16);
    EXPECT_LT(RelErr(y16, y32), 3e-2) << what;
    ExpertGrads g32 = ref->Backward(p32.grad_y, p32.x, p32.counts, Weights(p32, lora), act32);
    ExpertGrads g16 = fast->Backward(p16.grad_y, p16.x, p16.counts, Weights(p16, lora), act16);
    EXPECT_EQ(g16.x.scalar_type(), at::kBFloat16);
    EXPECT_LT(RelErr(g16.x, g32.x), 3e-2) << what;
    for (const at::Tensor& t : {g16.gate_up_a, g16.gate_up_b, g16.down_a, g16.down_b}) {
      if (t.defined()) {
        EXPECT_EQ(t.scalar_type(), at::kFloat) << what;
      }
    }
    ExpectLoraGradsNear(g16, g32, 3e-2, what);
  }
}

// A frozen base (no base weight gradients) changes nothing else: dx and the
// LoRA gradients are bitwise those of the full backward.
TEST_P(BackendsAgree, FrozenBaseGivesTheSameLoraGrads) {
  const auto& [name, case_idx] = GetParam();
  const ExpertProblemShape& shape = Cases()[case_idx];
  auto backend = Backend(name);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    ExpertProblem p = MakeExpertProblem(shape, dtype, 11 + case_idx);
    for (const LoraSpec& spec : LoraSpecs()) {
      const std::string what = SpecName(shape, spec) + " " + at::toString(dtype);
      const ExpertWeights w = Weights(p, MakeExpertLora(shape, spec, at::kFloat, 12 + case_idx));
      at::Tensor act;
      backend->Forward(p.x, p.counts, w, &act);
      ExpertGrads full = backend->Backward(p.grad_y, p.x, p.counts, w, act);
      ExpertGrads frozen =
          backend->Backward(p.grad_y, p.x, p.counts, w, act, {.base_weight_grads = false});
      EXPECT_FALSE(frozen.gate_up_proj.defined()) << what;
      EXPECT_FALSE(frozen.down_proj.defined()) << what;
      full.gate_up_proj = full.down_proj = at::Tensor();
      ExpectGradsEqual(frozen, full, what);
    }
  }
}

// Recomputing the gate/up activations in backward (Forward keeps nothing)
// gives bitwise the outputs and gradients of the saved path.
TEST_P(BackendsAgree, RecomputeIsBitwiseTheSavedPath) {
  const auto& [name, case_idx] = GetParam();
  const ExpertProblemShape& shape = Cases()[case_idx];
  auto backend = Backend(name);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    ExpertProblem p = MakeExpertProblem(shape, dtype, 21 + case_idx);
    std::vector<ExpertLora> loras = {ExpertLora{}};
    for (const LoraSpec& spec : LoraSpecs())
      loras.push_back(MakeExpertLora(shape, spec, at::kFloat, 22 + case_idx));
    for (const ExpertLora& lora : loras) {
      for (bool base_grads : {true, false}) {
        const std::string what = shape.name + " " + at::toString(dtype) +
                                 (lora.has_gate_up() ? " gate_up" : "") +
                                 (lora.has_down() ? " down" : "") + (base_grads ? "" : " frozen");
        const ExpertWeights w = Weights(p, lora);
        at::Tensor act;
        at::Tensor y_saved = backend->Forward(p.x, p.counts, w, &act);
        at::Tensor y_recomputed = backend->Forward(p.x, p.counts, w, nullptr);
        EXPECT_TRUE(at::equal(y_saved, y_recomputed)) << what;
        const BackwardOptions options{.base_weight_grads = base_grads};
        ExpertGrads saved = backend->Backward(p.grad_y, p.x, p.counts, w, act, options);
        ExpertGrads recomputed =
            backend->Backward(p.grad_y, p.x, p.counts, w, at::Tensor(), options);
        ExpectGradsEqual(recomputed, saved, what);
      }
    }
  }
}

// Zero B matrices (a fresh PEFT adapter) leave the forward bitwise the base one.
TEST_P(BackendsAgree, ZeroLoraBIsBitwiseTheBaseForward) {
  const auto& [name, case_idx] = GetParam();
  const ExpertProblemShape& shape = Cases()[case_idx];
  auto backend = Backend(name);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    ExpertProblem p = MakeExpertProblem(shape, dtype, 31 + case_idx);
    ExpertLora lora = MakeExpertLora(shape, LoraSpecs()[0], at::kFloat, 32 + case_idx);
    lora.gate_up_b.zero_();
    lora.down_b.zero_();
    at::Tensor act_base, act_lora;
    at::Tensor y_base = backend->Forward(p.x, p.counts, Weights(p), &act_base);
    at::Tensor y_lora = backend->Forward(p.x, p.counts, Weights(p, lora), &act_lora);
    EXPECT_TRUE(at::equal(y_lora, y_base)) << shape.name << " " << at::toString(dtype);
    EXPECT_TRUE(at::equal(act_lora, act_base)) << shape.name << " " << at::toString(dtype);
  }
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

// The LoRA gradients (and dx) through ExpertFfn against central finite
// differences of L = sum(y * grad_y) in double precision, at random elements of
// each tensor; with the base trained or frozen, activations saved or
// recomputed, and counts with and without idle experts.
class LoraGradcheck : public ::testing::TestWithParam<std::string> {};

TEST_P(LoraGradcheck, MatchesFiniteDifferences) {
  ExpertProblemShape shape{"gc", 6, 5, 4, 3, 2, RoutingPattern::kSomeEmpty};
  ExpertProblem p = MakeExpertProblem(shape, at::kDouble, 17);
  ExpertLora lora_p = MakeExpertLora(shape, {.rank = 2, .scaling = 1.5}, at::kDouble, 18);
  shape.pattern = RoutingPattern::kUniform;
  ExpertProblem q = MakeExpertProblem(shape, at::kDouble, 19);  // every expert busy
  ExpertLora lora_q = MakeExpertLora(shape, {.rank = 3, .scaling = 0.5}, at::kDouble, 20);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(23);
  auto backend = Backend(GetParam());
  for (auto [prob, lora0] : {std::pair{&p, &lora_p}, std::pair{&q, &lora_q}}) {
    for (bool frozen : {false, true}) {
      for (bool recompute : {false, true}) {
        const std::string what =
            std::string(frozen ? "frozen" : "trained") + (recompute ? " recompute" : " saved");
        at::Tensor x = prob->x.clone().requires_grad_(true);
        at::Tensor gu = prob->gate_up_proj.clone().requires_grad_(!frozen);
        at::Tensor dn = prob->down_proj.clone().requires_grad_(!frozen);
        ExpertLora lora = *lora0;
        for (at::Tensor* t : {&lora.gate_up_a, &lora.gate_up_b, &lora.down_a, &lora.down_b})
          *t = t->clone().requires_grad_(true);
        at::Tensor loss =
            (ExpertFfn(*backend, x, prob->counts, {gu, dn, lora}, {.recompute = recompute}) *
             prob->grad_y)
                .sum();
        loss.backward();
        EXPECT_EQ(gu.grad().defined(), !frozen) << what;
        auto eval = [&] {
          ExpertWeights w{gu.detach(), dn.detach(), lora};
          for (at::Tensor* t :
               {&w.lora.gate_up_a, &w.lora.gate_up_b, &w.lora.down_a, &w.lora.down_b})
            *t = t->detach();
          return (backend->Forward(x.detach(), prob->counts, w, nullptr) * prob->grad_y)
              .sum()
              .item<double>();
        };
        const double eps = 1e-6;
        for (at::Tensor* t : {&x, &lora.gate_up_a, &lora.gate_up_b, &lora.down_a, &lora.down_b}) {
          ASSERT_TRUE(t->grad().defined()) << what;
          at::Tensor flat = t->detach().view({-1});
          at::Tensor analytic = t->grad().view({-1});
          at::Tensor probes = at::randint(flat.numel(), {3}, gen, at::kLong);
          for (int64_t k = 0; k < probes.numel(); ++k) {
            const int64_t i = probes[k].item<int64_t>();
            const double orig = flat[i].item<double>();
            flat[i] = orig + eps;
            const double plus = eval();
            flat[i] = orig - eps;
            const double minus = eval();
            flat[i] = orig;
            EXPECT_NEAR(analytic[i].item<double>(), (plus - minus) / (2 * eps), 1e-6)
                << what << " element " << i;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, LoraGradcheck, ::testing::Values("eager", "grouped"));

// The grouped backend on each instruction set this CPU can run (the wider
// sets held down with LimitIsa, so that each runs here), against eager:
// float32 forward and all gradients, and bfloat16 against the float32 result.
TEST(GroupedKernels, EveryInstructionSetMatchesEager) {
  using kernels::Isa;
  const ExpertProblemShape shapes[] = {
      {"odd", 70, 45, 37, 5, 2, RoutingPattern::kSkewed},
      {"some_empty", 50, 16, 8, 7, 3, RoutingPattern::kSomeEmpty},
  };
  for (Isa isa : kernels::kAllIsas) {
    if (static_cast<int>(isa) > static_cast<int>(kernels::DetectIsa())) continue;
    kernels::LimitIsa(isa);
    for (const ExpertProblemShape& shape : shapes) {
      const std::string what = std::string(kernels::IsaName(isa)) + " " + shape.name;
      ExpertProblem p = MakeExpertProblem(shape, at::kFloat, 77);
      auto ref = Backend("eager");
      auto fast = Backend("grouped");
      at::Tensor act_ref, act_fast;
      at::Tensor y_ref = ref->Forward(p.x, p.counts, Weights(p), &act_ref);
      at::Tensor y_fast = fast->Forward(p.x, p.counts, Weights(p), &act_fast);
      EXPECT_LT(RelErr(y_fast, y_ref), 1e-5) << what;
      ExpertGrads g_ref = ref->Backward(p.grad_y, p.x, p.counts, Weights(p), act_ref);
      ExpertGrads g_fast = fast->Backward(p.grad_y, p.x, p.counts, Weights(p), act_fast);
      EXPECT_LT(RelErr(g_fast.x, g_ref.x), 1e-5) << what;
      EXPECT_LT(RelErr(g_fast.gate_up_proj, g_ref.gate_up_proj), 1e-5) << what;
      EXPECT_LT(RelErr(g_fast.down_proj, g_ref.down_proj), 1e-5) << what;

      ExpertProblem p16 = MakeExpertProblem(shape, at::kBFloat16, 77);
      at::Tensor act16;
      at::Tensor y16 = fast->Forward(p16.x, p16.counts, Weights(p16), &act16);
      EXPECT_LT(RelErr(y16, y_ref), 3e-2) << what;
      ExpertGrads g16 = fast->Backward(p16.grad_y, p16.x, p16.counts, Weights(p16), act16);
      EXPECT_LT(RelErr(g16.x, g_ref.x), 3e-2) << what;
      EXPECT_LT(RelErr(g16.gate_up_proj, g_ref.gate_up_proj), 3e-2) << what;
      EXPECT_LT(RelErr(g16.down_proj, g_ref.down_proj), 3e-2) << what;
    }
  }
  kernels::LimitIsa(kernels::DetectIsa());
}

// A token's output and input gradient do not depend on how its expert's rows
// are cut into segments (one process, or one segment per source rank): the
// grouped backend gives them bit for bit, for experts with few rows (the
// streamed GEMM path) and with many (the blocked one), in float32 and
// bfloat16, on every instruction set the CPU has (avx512_bf16 in both of its
// forms, bfloat16 pairs and widened).
TEST(GroupedKernels, RowsGiveTheSameBitsHoweverSegmented) {
  using kernels::Isa;
  // 16 experts, top-2 of 40 tokens, skewed: a few hot experts, many with a
  // handful of rows.
  const ExpertProblemShape shape{"mixed", 40, 72, 40, 16, 2, RoutingPattern::kSkewed};
  const std::pair<Isa, std::optional<bool>> forms[] = {{Isa::kAvx2, std::nullopt},
                                                       {Isa::kAvx512, std::nullopt},
                                                       {Isa::kAvx512Bf16, true},
                                                       {Isa::kAvx512Bf16, false},
                                                       {Isa::kAmxBf16, std::nullopt}};
  for (const auto& [isa, pairs] : forms) {
    if (static_cast<int>(isa) > static_cast<int>(kernels::DetectIsa())) continue;
    kernels::LimitIsa(isa);
    kernels::internal::SetBf16Pairs(pairs);
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const std::string what =
          kernels::IsaDescription(isa) + (dtype == at::kFloat ? " f32" : " bf16");
      ExpertProblem p = MakeExpertProblem(shape, dtype, 9);
      const int64_t num_experts = shape.num_experts;
      bool few = false, many = false;
      for (int64_t c : p.counts) {
        few |= c > 1 && c <= kernels::kMaxStreamedRows;
        many |= c > kernels::kMaxStreamedRows;
      }
      ASSERT_TRUE(few && many) << "the problem must exercise both paths";
      // Each expert's rows split in two segments, as two source ranks send them.
      std::vector<int64_t> begin(num_experts, 0), seg_counts(2 * num_experts), perm;
      for (int64_t e = 1; e < num_experts; ++e) begin[e] = begin[e - 1] + p.counts[e - 1];
      for (int half = 0; half < 2; ++half) {
        for (int64_t e = 0; e < num_experts; ++e) {
          const int64_t first = (p.counts[e] + 1) / 2;
          const int64_t from = half == 0 ? 0 : first, n = half == 0 ? first : p.counts[e] - first;
          seg_counts[half * num_experts + e] = n;
          for (int64_t r = 0; r < n; ++r) perm.push_back(begin[e] + from + r);
        }
      }
      at::Tensor idx = at::tensor(perm, at::kLong);
      auto fast = Backend("grouped");
      at::Tensor act, act_seg;
      at::Tensor y = fast->Forward(p.x, p.counts, Weights(p), &act);
      at::Tensor y_seg = fast->Forward(p.x.index_select(0, idx), seg_counts, Weights(p), &act_seg);
      EXPECT_TRUE(at::equal(y_seg, y.index_select(0, idx))) << what;
      ExpertGrads g = fast->Backward(p.grad_y, p.x, p.counts, Weights(p), act);
      ExpertGrads g_seg = fast->Backward(p.grad_y.index_select(0, idx), p.x.index_select(0, idx),
                                         seg_counts, Weights(p), act_seg);
      EXPECT_TRUE(at::equal(g_seg.x, g.x.index_select(0, idx))) << what;
    }
  }
  kernels::internal::SetBf16Pairs(std::nullopt);
  kernels::LimitIsa(kernels::DetectIsa());
}

// The tiles compute the same products whichever threads run them: the
// grouped backend on LibTorch's OpenMP threads and on a oneTBB arena gives the
// same bits, forward and backward, with LoRA adapters on both projections, on
// skewed routing (hot experts split over several tiles).
TEST(GroupedKernels, ThreadPoolsGiveTheSameBits) {
  const ExpertProblemShape shape{"skewed", 96, 72, 40, 8, 2, RoutingPattern::kSkewed};
  ExpertProblem p = MakeExpertProblem(shape, at::kFloat, 21);
  const ExpertWeights w = Weights(p, MakeExpertLora(shape, {.rank = 4}, at::kFloat, 22));
  struct Result {
    at::Tensor y;
    ExpertGrads g;
  };
  auto run = [&](ThreadPool pool) {
    auto b = CreateExpertBackend("grouped", {.num_threads = 3, .thread_pool = pool});
    EXPECT_TRUE(b.ok()) << b.status();
    at::Tensor act;
    Result r;
    r.y = (*b)->Forward(p.x, p.counts, w, &act);
    r.g = (*b)->Backward(p.grad_y, p.x, p.counts, w, act);
    return r;
  };
  const Result omp = run(ThreadPool::kOpenMp), tbb = run(ThreadPool::kOneTbb);
  EXPECT_TRUE(at::equal(omp.y, tbb.y));
  EXPECT_TRUE(at::equal(omp.g.x, tbb.g.x));
  EXPECT_TRUE(at::equal(omp.g.gate_up_proj, tbb.g.gate_up_proj));
  EXPECT_TRUE(at::equal(omp.g.down_proj, tbb.g.down_proj));
  for (auto field : {&ExpertGrads::gate_up_a, &ExpertGrads::gate_up_b, &ExpertGrads::down_a,
                     &ExpertGrads::down_b}) {
    ASSERT_TRUE((omp.g.*field).defined());
    EXPECT_TRUE(at::equal(omp.g.*field, tbb.g.*field));
  }
  // And the OpenMP run agrees with the eager reference.
  auto ref = Backend("eager");
  at::Tensor act_ref;
  const at::Tensor y_ref = ref->Forward(p.x, p.counts, w, &act_ref);
  EXPECT_LT(RelErr(omp.y, y_ref), 1e-5);
  EXPECT_LT(RelErr(omp.g.x, ref->Backward(p.grad_y, p.x, p.counts, w, act_ref).x), 1e-5);
}

// The grouped backend keeps its weights packed between calls
// (packed_weights.h, from their second use on) and never uses a pack after
// the weight changed: after
// an in-place ATen update, and after a raw write that bumps the version
// counter as FusedAdamW does, forward and backward (saved and recomputed
// activations) give the bits of a backend that packs per call, on every
// instruction set, float32 and bfloat16. A raw write that does not bump it
// is still seen by experts on the streamed path only: proof that the packs
// are really used, and that the version counter is what keeps them fresh.
TEST(GroupedKernels, PackedWeightsFollowEveryWeightChange) {
  using kernels::Isa;
  const ExpertProblemShape shape{"mixed", 60, 45, 37, 6, 2, RoutingPattern::kSkewed};
  for (Isa isa : kernels::kAllIsas) {
    if (static_cast<int>(isa) > static_cast<int>(kernels::DetectIsa())) continue;
    kernels::LimitIsa(isa);
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const std::string what =
          std::string(kernels::IsaName(isa)) + (dtype == at::kFloat ? " f32" : " bf16");
      ExpertProblem p = MakeExpertProblem(shape, dtype, 21);
      bool few = false, many = false;
      for (int64_t c : p.counts) {
        few |= c > 0 && c <= kernels::kMaxStreamedRows;
        many |= c > kernels::kMaxStreamedRows;
      }
      ASSERT_TRUE(few && many) << "the problem must exercise both paths";
      auto cached = Backend("grouped");
      auto per_call = CreateExpertBackend("grouped", {.num_threads = 2, .packed_weight_bytes = 0});
      ASSERT_TRUE(per_call.ok());
      // Runs both backends (saved and recomputed activations) and checks
      // that they agree bit for bit; returns the cached backend's output.
      auto run_and_compare = [&](const std::string& step) {
        at::Tensor act_a, act_b;
        at::Tensor y_a = cached->Forward(p.x, p.counts, Weights(p), &act_a);
        at::Tensor y_b = (*per_call)->Forward(p.x, p.counts, Weights(p), &act_b);
        EXPECT_TRUE(at::equal(y_a, y_b)) << what << " " << step;
        for (bool recompute : {false, true}) {
          ExpertGrads g_a = cached->Backward(p.grad_y, p.x, p.counts, Weights(p),
                                             recompute ? at::Tensor() : act_a);
          ExpertGrads g_b = (*per_call)->Backward(p.grad_y, p.x, p.counts, Weights(p),
                                                  recompute ? at::Tensor() : act_b);
          ExpectGradsEqual(g_a, g_b, what + " " + step + (recompute ? " recomputed" : ""));
        }
        return y_a;
      };
      const at::Tensor y0 = run_and_compare("first");
      // An optimizer's ATen twin: in-place ops bump the version.
      {
        at::NoGradGuard no_grad;
        p.gate_up_proj.mul_(1.5);
        p.down_proj.add_(at::ones_like(p.down_proj), 0.01);
      }
      const at::Tensor y1 = run_and_compare("after in-place ops");
      EXPECT_FALSE(at::equal(y1, y0)) << what;
      // A raw write (as FusedAdamW's fused pass), with the version bumped.
      auto raw_scale = [](at::Tensor w, float f) {
        at::Tensor scaled = (w.to(at::kFloat) * f).to(w.scalar_type());
        std::memcpy(w.data_ptr(), scaled.const_data_ptr(), w.nbytes());
      };
      raw_scale(p.gate_up_proj, -0.5f);
      p.gate_up_proj.unsafeGetTensorImpl()->bump_version();
      const at::Tensor y2 = run_and_compare("after a raw write");
      EXPECT_FALSE(at::equal(y2, y1)) << what;
      // Without the bump, experts on the blocked path keep multiplying by
      // their packs (stale; the forward's gate/up packs were made by the
      // recomputation above, their second use); the per-call backend sees
      // the new weights.
      raw_scale(p.gate_up_proj, 2.0f);
      at::Tensor act;
      const at::Tensor y_stale = cached->Forward(p.x, p.counts, Weights(p), &act);
      const at::Tensor y_fresh = (*per_call)->Forward(p.x, p.counts, Weights(p), &act);
      int64_t row = 0;
      for (int64_t e = 0; e < shape.num_experts; ++e) {
        const int64_t n = p.counts[e];
        if (n > 0) {
          const bool same = at::equal(y_stale.narrow(0, row, n), y_fresh.narrow(0, row, n));
          EXPECT_EQ(same, n <= kernels::kMaxStreamedRows) << what << " expert " << e;
          EXPECT_EQ(at::equal(y_stale.narrow(0, row, n), y2.narrow(0, row, n)),
                    n > kernels::kMaxStreamedRows)
              << what << " expert " << e;
        }
        row += n;
      }
    }
  }
  kernels::LimitIsa(kernels::DetectIsa());
}

// SwiGLU fused into the gate/up GEMM (column blocks, vector exp) against its
// slow twin (one GEMM, then the scalar pass) on every instruction set, in
// float32, bfloat16 and frozen FP8, with saved and recomputed activations:
// the gate/up pre-activations bit for bit (the GEMMs' columns do not depend
// on the blocking); everything after SiLU within the vector exp's few units
// in the last place (float32: 1e-5 of the largest magnitude; bfloat16: 1e-2,
// a bfloat16 rounding moved by it); on the portable kernels, which use
// std::exp in the same order, bit for bit. Shapes: I not a multiple of the
// column block, I over two blocks with a tail, and FP8 halves on and off a
// scale block (off: the unfused GEMM with the vector pass).
TEST(GroupedKernels, FusedSwiGluMatchesTheScalarTwin) {
  using kernels::Isa;
  const ExpertProblemShape shapes[] = {
      {"odd", 70, 45, 37, 5, 2, RoutingPattern::kSkewed},
      {"blocks", 60, 40, 600, 4, 2, RoutingPattern::kSkewed},
      {"fp8_aligned", 40, 130, 256, 3, 2, RoutingPattern::kUniform},
      {"some_empty", 50, 16, 8, 7, 3, RoutingPattern::kSomeEmpty},
  };
  for (Isa isa : kernels::kAllIsas) {
    if (static_cast<int>(isa) > static_cast<int>(kernels::DetectIsa())) continue;
    kernels::LimitIsa(isa);
    const bool exact = isa == Isa::kPortable;
    for (const ExpertProblemShape& shape : shapes) {
      // kByte: int4 weights.
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kFloat8_e4m3fn, at::kByte}) {
        const bool int4 = dtype == at::kByte;
        const bool fp8 = dtype == at::kFloat8_e4m3fn || int4;  // frozen, bfloat16 activations
        const std::string what = std::string(kernels::IsaName(isa)) + " " + shape.name + " " +
                                 std::string(int4 ? "int4" : c10::toString(dtype));
        ExpertProblem p = MakeExpertProblem(shape, fp8 ? at::kBFloat16 : dtype, 31);
        const ExpertWeights w = int4  ? QuantizeInt4Experts(p, 32)
                                : fp8 ? QuantizeFp8(p)
                                      : Weights(p);
        const double tol = exact ? 0.0 : (dtype == at::kFloat ? 1e-5 : 1e-2);
        auto fused = CreateExpertBackend("grouped", {.num_threads = 2});
        auto twin = CreateExpertBackend("grouped", {.num_threads = 2, .fused_swiglu = false});
        ASSERT_TRUE(fused.ok() && twin.ok());
        at::Tensor act_f, act_t;
        const at::Tensor y_f = (*fused)->Forward(p.x, p.counts, w, &act_f);
        const at::Tensor y_t = (*twin)->Forward(p.x, p.counts, w, &act_t);
        EXPECT_TRUE(at::equal(act_f, act_t)) << what << " gate/up";
        EXPECT_LE(RelErr(y_f, y_t), tol) << what << " y";
        const BackwardOptions options{.base_weight_grads = !fp8};
        for (bool recompute : {false, true}) {
          const std::string w_what = what + (recompute ? " recomputed" : "");
          ExpertGrads g_f = (*fused)->Backward(p.grad_y, p.x, p.counts, w,
                                               recompute ? at::Tensor() : act_f, options);
          ExpertGrads g_t = (*twin)->Backward(p.grad_y, p.x, p.counts, w,
                                              recompute ? at::Tensor() : act_t, options);
          EXPECT_LE(RelErr(g_f.x, g_t.x), tol) << w_what << " dx";
          if (!fp8) {
            EXPECT_LE(RelErr(g_f.gate_up_proj, g_t.gate_up_proj), tol) << w_what;
            EXPECT_LE(RelErr(g_f.down_proj, g_t.down_proj), tol) << w_what;
          }
        }
      }
    }
  }
  kernels::LimitIsa(kernels::DetectIsa());
}

// The vector SwiGLU kernels against the scalar ones (portable) on rows with
// a tail, over the range where exp over- and underflows, element by element:
// within 8 float32 units in the last place of the magnitudes involved.
TEST(SwiGluKernels, VectorMatchesScalarElementwise) {
  using kernels::Isa;
  const int64_t m = 3, n = 203;
  at::Tensor g = at::linspace(-100, 100, m * n).reshape({m, n}).contiguous();
  at::Tensor u = at::randn({m, n}), dh = at::randn({m, n});
  auto run = [&](Isa isa) {
    std::vector<at::Tensor> out;
    for (int i = 0; i < 4; ++i) out.push_back(at::empty({m, n}));
    auto rows = [](const at::Tensor& t) {
      return kernels::Rows{t.data_ptr(), kernels::ElemType::kF32, t.stride(0)};
    };
    kernels::SiluMul(isa, m, n, rows(g), rows(u), rows(out[0]));
    kernels::SiluMulBackward(isa, m, n, rows(g), rows(u), rows(dh), rows(out[1]), rows(out[2]),
                             rows(out[3]));
    return out;
  };
  const std::vector<at::Tensor> ref = run(Isa::kPortable);
  // Each output's scale per element: |g|·|u| bounds h and d_up·|dh|/|dh|,
  // and |dh|·|u|·(1 + |g|) bounds d_gate.
  const at::Tensor h_scale = g.abs() * u.abs() + 1e-30;
  const std::vector<at::Tensor> scales = {h_scale, h_scale, dh.abs() * u.abs() * (1 + g.abs()),
                                          dh.abs() * g.abs() + 1e-30};
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmxBf16}) {
    if (static_cast<int>(isa) > static_cast<int>(kernels::DetectIsa())) continue;
    const std::vector<at::Tensor> got = run(isa);
    for (size_t i = 0; i < got.size(); ++i) {
      const double worst = ((got[i] - ref[i]).abs() / scales[i]).max().item<double>();
      EXPECT_LE(worst, 8 * std::ldexp(1.0, -23)) << kernels::IsaName(isa) << " output " << i;
    }
  }
}

// Frozen FP8 weights with 128 x 128 block scales: forward and dX (with and
// without LoRA adapters, whose gradients are checked too) against eager,
// which dequantizes each expert's weights whole. Shapes span several scale
// blocks and end inside one.
TEST(GroupedKernels, Fp8FrozenWeightsMatchEager) {
  const ExpertProblemShape shapes[] = {
      {"blocks", 60, 200, 140, 5, 2, RoutingPattern::kSkewed},
      {"some_empty", 50, 16, 8, 7, 3, RoutingPattern::kSomeEmpty},
      {"tiny", 1, 8, 4, 3, 1, RoutingPattern::kUniform},
  };
  const bool rounds = kernels::MultipliesInBf16(kernels::ActiveIsa());
  for (const ExpertProblemShape& shape : shapes) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      for (bool with_lora : {false, true}) {
        const std::string what =
            shape.name + (dtype == at::kFloat ? " f32" : " bf16") + (with_lora ? " lora" : "");
        ExpertProblem p = MakeExpertProblem(shape, dtype, 5);
        ExpertWeights w = QuantizeFp8(p);
        if (with_lora) w.lora = MakeExpertLora(shape, {.rank = 3}, at::kFloat, 6);
        auto ref = Backend("eager");
        auto fast = Backend("grouped");
        at::Tensor act_ref, act_fast;
        at::Tensor y_ref = ref->Forward(p.x, p.counts, w, &act_ref);
        at::Tensor y_fast = fast->Forward(p.x, p.counts, w, &act_fast);
        // float32 activations on avx512_bf16 and amx_bf16 are rounded to bfloat16 for
        // vdpbf16ps (and FP8 x scale too), while eager stays in float32.
        const double tol = dtype == at::kBFloat16 ? 3e-2 : rounds ? 2e-2 : 1e-5;
        EXPECT_LT(RelErr(y_fast, y_ref), tol) << what;
        const BackwardOptions frozen{.base_weight_grads = false};
        ExpertGrads g_ref = ref->Backward(p.grad_y, p.x, p.counts, w, act_ref, frozen);
        ExpertGrads g_fast = fast->Backward(p.grad_y, p.x, p.counts, w, act_fast, frozen);
        EXPECT_LT(RelErr(g_fast.x, g_ref.x), tol) << what;
        EXPECT_FALSE(g_fast.gate_up_proj.defined());
        if (with_lora) ExpectLoraGradsNear(g_fast, g_ref, tol, what);
      }
    }
  }
}

// Where the kernels multiply bfloat16 pairs, frozen FP8 weights give the
// bits of their bfloat16 dequantization (FP8 x scale rounded once), through
// the whole layer: forward, activations, dX and the LoRA gradients, with
// experts of a few rows (streamed) and of many (blocked, kept packs on the
// second call).
TEST(GroupedKernels, Fp8WeightsGiveTheBitsOfTheirBfloat16Dequantization) {
  const ExpertProblemShape shape{"mixed", 80, 256, 256, 6, 2, RoutingPattern::kSkewed};
  for (const kernels::Isa isa : kernels::kAllIsas) {
    if (isa > kernels::DetectIsa() || !kernels::MultipliesInBf16(isa)) continue;
    kernels::LimitIsa(isa);
    for (const bool with_lora : {false, true}) {
      const std::string what = std::string(kernels::IsaName(isa)) + (with_lora ? " lora" : " base");
      ExpertProblem p = MakeExpertProblem(shape, at::kBFloat16, 9);
      ExpertWeights fp8 = QuantizeFp8(p);
      ExpertWeights bf16 = fp8;
      auto dequantize = [](const at::Tensor& w, const at::Tensor& s) {
        const at::Tensor full = s.repeat_interleave(128, 1)
                                    .repeat_interleave(128, 2)
                                    .narrow(1, 0, w.size(1))
                                    .narrow(2, 0, w.size(2));
        return (w.to(at::kFloat) * full).to(at::kBFloat16).contiguous();
      };
      bf16.gate_up_proj = dequantize(fp8.gate_up_proj, fp8.gate_up_scale);
      bf16.down_proj = dequantize(fp8.down_proj, fp8.down_scale);
      bf16.gate_up_scale = bf16.down_scale = at::Tensor();
      if (with_lora) fp8.lora = bf16.lora = MakeExpertLora(shape, {.rank = 4}, at::kFloat, 10);
      auto a = Backend("grouped");
      auto b = Backend("grouped");
      for (int call = 0; call < 2; ++call) {
        at::Tensor act_a, act_b;
        const at::Tensor ya = a->Forward(p.x, p.counts, fp8, &act_a);
        const at::Tensor yb = b->Forward(p.x, p.counts, bf16, &act_b);
        EXPECT_TRUE(at::equal(act_a, act_b)) << what << " call " << call;
        EXPECT_TRUE(at::equal(ya, yb)) << what << " call " << call;
        const BackwardOptions frozen{.base_weight_grads = false};
        const ExpertGrads ga = a->Backward(p.grad_y, p.x, p.counts, fp8, act_a, frozen);
        const ExpertGrads gb = b->Backward(p.grad_y, p.x, p.counts, bf16, act_b, frozen);
        EXPECT_TRUE(at::equal(ga.x, gb.x)) << what << " call " << call;
        if (with_lora) {
          EXPECT_TRUE(at::equal(ga.gate_up_a, gb.gate_up_a)) << what;
          EXPECT_TRUE(at::equal(ga.gate_up_b, gb.gate_up_b)) << what;
          EXPECT_TRUE(at::equal(ga.down_a, gb.down_a)) << what;
          EXPECT_TRUE(at::equal(ga.down_b, gb.down_b)) << what;
        }
      }
    }
  }
  kernels::LimitIsa(kernels::DetectIsa());
}

// Frozen int4 weights (compressed-tensors' groups, symmetric and with zero
// points, groups of 32 and 128) on every instruction set this CPU can run,
// the wider ones held down: forward and dX, with and without LoRA adapters
// (whose gradients are checked too), against eager, which dequantizes each
// expert's weights whole. Shapes with a partial last group and rows not
// filling whole 32-bit words (H 70, I 45), experts with no rows, one row and
// many.
TEST(GroupedKernels, Int4FrozenWeightsMatchEager) {
  const ExpertProblemShape shapes[] = {
      {"tails", 60, 70, 45, 5, 2, RoutingPattern::kSkewed},
      {"some_empty", 50, 16, 8, 7, 3, RoutingPattern::kSomeEmpty},
      {"one_row", 1, 64, 40, 3, 1, RoutingPattern::kUniform},
      {"groups_128", 40, 300, 260, 4, 2, RoutingPattern::kSkewed},
  };
  for (const kernels::Isa isa : kernels::kAllIsas) {
    if (isa > kernels::DetectIsa()) continue;
    kernels::LimitIsa(isa);
    const bool rounds = kernels::MultipliesInBf16(isa);
    for (const ExpertProblemShape& shape : shapes) {
      const int64_t group = shape.hidden >= 256 ? 128 : 32;
      for (const bool symmetric : {true, false}) {
        for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
          for (bool with_lora : {false, true}) {
            const std::string what = std::string(kernels::IsaName(isa)) + " " + shape.name +
                                     (symmetric ? " symmetric" : " zero points") +
                                     (dtype == at::kFloat ? " f32" : " bf16") +
                                     (with_lora ? " lora" : "");
            ExpertProblem p = MakeExpertProblem(shape, dtype, 15);
            ExpertWeights w = QuantizeInt4Experts(p, group, symmetric);
            if (with_lora) w.lora = MakeExpertLora(shape, {.rank = 3}, at::kFloat, 16);
            auto ref = Backend("eager");
            auto fast = Backend("grouped");
            at::Tensor act_ref, act_fast;
            const at::Tensor y_ref = ref->Forward(p.x, p.counts, w, &act_ref);
            const at::Tensor y_fast = fast->Forward(p.x, p.counts, w, &act_fast);
            // The weights' values are bfloat16 on every set; float32
            // activations are rounded to bfloat16 only where the kernels
            // multiply bfloat16 pairs.
            const double tol = dtype == at::kBFloat16 ? 3e-2 : rounds ? 2e-2 : 1e-5;
            EXPECT_LT(RelErr(y_fast, y_ref), tol) << what;
            const BackwardOptions frozen{.base_weight_grads = false};
            const ExpertGrads g_ref = ref->Backward(p.grad_y, p.x, p.counts, w, act_ref, frozen);
            const ExpertGrads g_fast = fast->Backward(p.grad_y, p.x, p.counts, w, act_fast, frozen);
            EXPECT_LT(RelErr(g_fast.x, g_ref.x), tol) << what;
            EXPECT_FALSE(g_fast.gate_up_proj.defined());
            if (with_lora) ExpectLoraGradsNear(g_fast, g_ref, tol, what);
            // The base gradients of frozen int4 weights are refused.
            EXPECT_THROW(fast->Backward(p.grad_y, p.x, p.counts, w, act_fast, {}), c10::Error);
          }
        }
      }
    }
  }
  kernels::LimitIsa(kernels::DetectIsa());
}

// On every instruction set, frozen int4 weights give the bits of their
// bfloat16 dequantization through the whole layer: forward, activations, dX
// and the LoRA gradients, float32 and bfloat16 activations, with experts of
// a few rows (streamed), of many (blocked, kept packs from the second call),
// and of none.
TEST(GroupedKernels, Int4WeightsGiveTheBitsOfTheirBfloat16Dequantization) {
  const ExpertProblemShape shape{"mixed", 80, 256, 192, 6, 2, RoutingPattern::kSkewed};
  for (const kernels::Isa isa : kernels::kAllIsas) {
    if (isa > kernels::DetectIsa()) continue;
    kernels::LimitIsa(isa);
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      for (const bool with_lora : {false, true}) {
        const std::string what = std::string(kernels::IsaName(isa)) +
                                 (dtype == at::kFloat ? " f32" : " bf16") +
                                 (with_lora ? " lora" : " base");
        ExpertProblem p = MakeExpertProblem(shape, dtype, 19);
        ExpertWeights int4 = QuantizeInt4Experts(p, 32, /*symmetric=*/false);
        ExpertWeights bf16;
        bf16.gate_up_proj = DequantizeInt4(
            {int4.gate_up_proj, int4.gate_up_scale, int4.gate_up_zero_point}, 32, shape.hidden);
        bf16.down_proj = DequantizeInt4({int4.down_proj, int4.down_scale, int4.down_zero_point}, 32,
                                        shape.intermediate);
        if (with_lora) int4.lora = bf16.lora = MakeExpertLora(shape, {.rank = 4}, at::kFloat, 20);
        auto a = Backend("grouped");
        auto b = Backend("grouped");
        for (int call = 0; call < 2; ++call) {
          at::Tensor act_a, act_b;
          const at::Tensor ya = a->Forward(p.x, p.counts, int4, &act_a);
          const at::Tensor yb = b->Forward(p.x, p.counts, bf16, &act_b);
          EXPECT_TRUE(at::equal(act_a, act_b)) << what << " call " << call;
          EXPECT_TRUE(at::equal(ya, yb)) << what << " call " << call;
          const BackwardOptions frozen{.base_weight_grads = false};
          const ExpertGrads ga = a->Backward(p.grad_y, p.x, p.counts, int4, act_a, frozen);
          const ExpertGrads gb = b->Backward(p.grad_y, p.x, p.counts, bf16, act_b, frozen);
          EXPECT_TRUE(at::equal(ga.x, gb.x)) << what << " call " << call;
          if (with_lora) {
            EXPECT_TRUE(at::equal(ga.gate_up_a, gb.gate_up_a)) << what;
            EXPECT_TRUE(at::equal(ga.gate_up_b, gb.gate_up_b)) << what;
            EXPECT_TRUE(at::equal(ga.down_a, gb.down_a)) << what;
            EXPECT_TRUE(at::equal(ga.down_b, gb.down_b)) << what;
          }
        }
        EXPECT_GT(a->kept_pack_bytes(), 0) << what;
      }
    }
  }
  kernels::LimitIsa(kernels::DetectIsa());
}

// The quantizer and the reference dequantization: every element within half
// a step of its weight (symmetric: scale / 2; zero points: the same, inside
// the range), each row padded to whole 32-bit words with zero nibbles, the
// two nibbles of a byte in element order, and an all-zero group scaled 1.
TEST(Int4, QuantizeThenDequantizeStaysWithinHalfAStep) {
  at::manual_seed(3);
  const int64_t rows = 5, cols = 70, group = 32;
  at::Tensor w = at::randn({2, rows, cols});
  w[1][2].narrow(0, 32, 32).zero_();  // group 1 of row 2 of expert 1
  for (const bool symmetric : {true, false}) {
    const Int4Weight q = QuantizeInt4(w, group, symmetric);
    ASSERT_EQ(q.bytes.sizes(), at::IntArrayRef({2, rows, Int4RowBytes(cols)}));
    ASSERT_EQ(q.scale.sizes(), at::IntArrayRef({2, rows, 3}));
    EXPECT_EQ(q.zero_point.defined(), !symmetric);
    const at::Tensor deq = DequantizeInt4(q, group, cols).to(at::kFloat);
    const at::Tensor step = q.scale.to(at::kFloat).repeat_interleave(group, -1).narrow(-1, 0, cols);
    // Half a step, plus the bfloat16 rounding of the dequantized value.
    const at::Tensor bound = step * 0.5 + deq.abs() * std::ldexp(1.0, -8) + 1e-6;
    EXPECT_TRUE((deq - w).abs().le(bound).all().item<bool>()) << symmetric;
    EXPECT_EQ(q.scale[1][2][1].item<float>(), 1.0f);
    // Element 69 is the high nibble of byte 34; byte 35 holds padding only.
    const at::Tensor flat = q.bytes.reshape({-1, Int4RowBytes(cols)});
    EXPECT_TRUE(flat.narrow(1, 35, 1).eq(0).all().item<bool>());
    const int64_t u69 = flat[0][34].item<int64_t>() >> 4;
    const float want = static_cast<float>(c10::BFloat16(
        static_cast<float>(u69 - 8 - (symmetric ? 0 : q.zero_point[0][0][2].item<int64_t>())) *
        q.scale[0][0][2].item<float>()));
    EXPECT_EQ(deq[0][0][69].item<float>(), want);
  }
}

// Stored rows for a problem's A rows read by index: about half as many rows
// as A, each read up to several times, in shuffled order. Returns the stored
// rows and the index; stored.index_select(0, index) is the rows copied out.
std::pair<at::Tensor, at::Tensor> IndexedRows(const ExpertProblem& p, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t a_rows = p.x.size(0), stored_rows = a_rows / 2 + 1;
  at::Tensor stored = at::randn({stored_rows, p.x.size(1)}, gen, at::kFloat).to(p.x.scalar_type());
  at::Tensor index = at::randint(stored_rows, {a_rows}, gen, at::kLong);
  return {stored, index};
}

// The inverse of `index` as ExpertFfnOptions::row_copies wants it: row r
// lists the computation rows that read it, in increasing order.
at::Tensor CopiesOf(const at::Tensor& index, int64_t stored_rows) {
  std::vector<std::vector<int64_t>> lists(stored_rows);
  for (int64_t a = 0; a < index.numel(); ++a) lists[index[a].item<int64_t>()].push_back(a);
  size_t f = 1;
  for (const auto& l : lists) f = std::max(f, l.size());
  at::Tensor copies = at::full({stored_rows, static_cast<int64_t>(f)}, -1, at::kLong);
  for (int64_t r = 0; r < stored_rows; ++r) {
    for (size_t j = 0; j < lists[r].size(); ++j) copies[r][j] = lists[r][j];
  }
  return copies;
}

// The grouped backend reading its input rows by index gives the bits of the
// same rows copied out first, forward and backward (every gradient, saved and
// recomputed activations, trained and frozen base, with and without LoRA,
// FP8 frozen weights), on every instruction set the CPU has, in float32 and
// bfloat16; float64 (LibTorch's mm) and eager copy the rows out themselves.
TEST(GroupedKernels, RowsReadByIndexGiveTheBitsOfTheRowsCopiedOut) {
  using kernels::Isa;
  const ExpertProblemShape shapes[] = {
      {"mixed", 40, 72, 40, 16, 2, RoutingPattern::kSkewed},
      {"fp8_blocks", 30, 130, 128, 3, 2, RoutingPattern::kUniform},
  };
  for (Isa isa : kernels::kAllIsas) {
    if (static_cast<int>(isa) > static_cast<int>(kernels::DetectIsa())) continue;
    kernels::LimitIsa(isa);
    for (const ExpertProblemShape& shape : shapes) {
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kDouble}) {
        for (int variant = 0; variant < 5; ++variant) {
          // 0: base; 1: LoRA, frozen base, recomputed; 2: LoRA, trained base;
          // 3: FP8 frozen base with LoRA; 4: int4 frozen base with LoRA.
          if (variant >= 3 && dtype == at::kDouble) continue;
          const bool lora = variant >= 1, frozen = variant == 1 || variant >= 3;
          const bool recompute = variant == 1;
          const std::string what = std::string(kernels::IsaName(isa)) + " " + shape.name + " " +
                                   std::string(c10::toString(dtype)) + " variant " +
                                   std::to_string(variant);
          ExpertProblem p = MakeExpertProblem(shape, dtype, 21);
          ExpertWeights w = variant == 3   ? QuantizeFp8(p)
                            : variant == 4 ? QuantizeInt4Experts(p, 32, /*symmetric=*/false)
                                           : Weights(p);
          if (lora) {
            w.lora = MakeExpertLora(shape, {.rank = 3},
                                    dtype == at::kDouble ? at::kDouble : at::kFloat, 22);
          }
          auto [stored, index] = IndexedRows(p, 23);
          const at::Tensor copied = stored.index_select(0, index);
          const BackwardOptions options{.base_weight_grads = !frozen};
          for (const char* name : {"grouped", "eager"}) {
            auto backend = Backend(name);
            at::Tensor act_copied, act_indexed;
            at::Tensor* keep_copied = recompute ? nullptr : &act_copied;
            at::Tensor* keep_indexed = recompute ? nullptr : &act_indexed;
            at::Tensor y = backend->Forward(copied, p.counts, w, keep_copied);
            at::Tensor y_idx = backend->Forward(stored, index, p.counts, w, keep_indexed);
            EXPECT_TRUE(at::equal(y_idx, y)) << name << " " << what;
            ExpertGrads g = backend->Backward(p.grad_y, copied, p.counts, w, act_copied, options);
            ExpertGrads g_idx =
                backend->Backward(p.grad_y, stored, index, p.counts, w, act_indexed, options);
            ExpectGradsEqual(g_idx, g, std::string(name) + " " + what);
          }
        }
      }
    }
  }
  kernels::LimitIsa(kernels::DetectIsa());
}

// ExpertFfn over rows read by index: the gradient of a stored row is the sum
// of the gradients of the rows that read it, as autograd gives it through
// index_select (float64); float32 and bfloat16 outputs are the bits of the
// copied-out rows'. Rows narrower than one block of the sum (32 float32
// values, 16 float64) and wider with a tail. Bad indices are refused with a
// message.
TEST(ExpertFfn, RowsReadByIndexSumTheirGradients) {
  const ExpertProblemShape shape{"idx", 30, 24, 16, 4, 2, RoutingPattern::kSkewed};
  const ExpertProblemShape wide{"idx_wide", 30, 75, 16, 4, 2, RoutingPattern::kSkewed};
  for (const ExpertProblemShape& sh : {shape, wide}) {
    for (at::ScalarType dtype : {at::kDouble, at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(sh.name);
      ExpertProblem p = MakeExpertProblem(sh, dtype, 31);
      auto [stored, index] = IndexedRows(p, 32);
      const at::Tensor copies = CopiesOf(index, stored.size(0));
      auto backend = Backend("grouped");
      at::Tensor x_idx = stored.clone().requires_grad_(true);
      at::Tensor x_ref = stored.clone().requires_grad_(true);
      at::Tensor gu = p.gate_up_proj.clone().requires_grad_(true);
      at::Tensor dn = p.down_proj.clone().requires_grad_(true);
      ExpertFfnOptions by_index;
      by_index.row_index = index;
      by_index.row_copies = copies;
      at::Tensor y_idx = ExpertFfn(*backend, x_idx, p.counts, {gu, dn}, by_index);
      at::Tensor y_ref = ExpertFfn(*backend, x_ref.index_select(0, index), p.counts, {gu, dn});
      EXPECT_TRUE(at::equal(y_idx, y_ref)) << dtype;
      (y_idx.to(at::kDouble) * p.grad_y.to(at::kDouble)).sum().backward();
      (y_ref.to(at::kDouble) * p.grad_y.to(at::kDouble)).sum().backward();
      if (dtype == at::kDouble) {
        EXPECT_TRUE(at::allclose(x_idx.grad(), x_ref.grad(), 1e-12, 1e-12));
      } else {
        // index_select's backward sums in the rows' dtype, ours in float32.
        EXPECT_LT(RelErr(x_idx.grad(), x_ref.grad()), dtype == at::kFloat ? 1e-6 : 1e-2) << dtype;
      }
    }
  }
  ExpertProblem p = MakeExpertProblem(shape, at::kFloat, 33);
  auto [stored, index] = IndexedRows(p, 34);
  auto backend = Backend("grouped");
  auto message = [&](const at::Tensor& idx, const at::Tensor& copies) -> std::string {
    ExpertFfnOptions o;
    o.row_index = idx;
    o.row_copies = copies;
    try {
      ExpertFfn(*backend, stored, p.counts, Weights(p), o);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "";
  };
  const at::Tensor copies = CopiesOf(index, stored.size(0));
  at::Tensor outside = index.clone();
  outside[3] = stored.size(0);
  EXPECT_NE(message(outside, copies).find("points outside x's"), std::string::npos);
  EXPECT_NE(message(index, at::Tensor()).find("give both row_index and row_copies"),
            std::string::npos);
  EXPECT_NE(message(index.narrow(0, 0, 5), copies).find("counts sum to"), std::string::npos);
  // A computation row listed twice, or under a row it does not read.
  at::Tensor twice = copies.clone();
  twice[0][0] = twice[1][0].item<int64_t>() >= 0 ? twice[1][0].item<int64_t>() : 0;
  EXPECT_NE(message(index, twice).find("must list each of the"), std::string::npos);
  at::Tensor swapped = copies.flip({0}).contiguous();
  EXPECT_NE(message(index, swapped).find("must list each of the"), std::string::npos);
}

// int4 weights are frozen: ExpertFfn refuses to train them (through float32
// masters), and wants their scales (of the right shape and dtype, one per
// group) and both zero points or neither.
TEST(ExpertFfnChecks, Int4WeightsAreFrozenAndNeedScales) {
  const ExpertProblemShape shape{"int4", 4, 40, 24, 2, 1, RoutingPattern::kUniform};
  ExpertProblem p = MakeExpertProblem(shape, at::kFloat, 1);
  const ExpertWeights w = QuantizeInt4Experts(p, 8, /*symmetric=*/false);
  auto backend = Backend("grouped");
  const at::Tensor y = ExpertFfn(*backend, p.x, p.counts, w);
  EXPECT_EQ(y.sizes(), p.x.sizes());
  auto message = [&](const ExpertWeights& bad) -> std::string {
    try {
      ExpertFfn(*backend, p.x, p.counts, bad);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "";
  };
  ExpertWeights bad = w;
  bad.down_scale = at::Tensor();
  EXPECT_NE(message(bad).find("bfloat16 scales"), std::string::npos);
  bad = w;
  bad.gate_up_scale = w.gate_up_scale.to(at::kFloat);
  EXPECT_NE(message(bad).find("bfloat16 scales"), std::string::npos);
  bad = w;
  bad.int4_group_size = 16;
  EXPECT_NE(message(bad).find("bfloat16 scales"), std::string::npos);
  bad = w;
  bad.down_zero_point = at::Tensor();
  EXPECT_NE(message(bad).find("both or neither"), std::string::npos);
  bad = w;
  bad.down_proj = w.down_proj.narrow(2, 0, 4).contiguous();
  EXPECT_NE(message(bad).find("shapes disagree"), std::string::npos);
  // (uint8 tensors cannot require grad; float32 masters would train them.)
  ExpertFfnOptions masters;
  masters.gate_up_master = at::zeros(w.gate_up_proj.sizes()).requires_grad_(true);
  masters.down_master = at::zeros(w.down_proj.sizes()).requires_grad_(true);
  try {
    ExpertFfn(*backend, p.x, p.counts, w, masters);
    ADD_FAILURE() << "int4 weights with masters were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("frozen"), std::string::npos);
  }
}

// FP8 weights are frozen: ExpertFfn refuses to train them, and wants scales.
TEST(ExpertFfnChecks, Fp8WeightsAreFrozenAndNeedScales) {
  const ExpertProblemShape shape{"fp8", 4, 8, 4, 2, 1, RoutingPattern::kUniform};
  ExpertProblem p = MakeExpertProblem(shape, at::kFloat, 1);
  ExpertWeights w = QuantizeFp8(p);
  auto backend = Backend("grouped");
  at::Tensor y = ExpertFfn(*backend, p.x, p.counts, w);
  EXPECT_EQ(y.sizes(), p.x.sizes());
  ExpertWeights no_scales = w;
  no_scales.down_scale = at::Tensor();
  EXPECT_THROW(ExpertFfn(*backend, p.x, p.counts, no_scales), c10::Error);
  ExpertWeights trained = w;
  trained.gate_up_proj = w.gate_up_proj.clone().set_requires_grad(true);
  EXPECT_THROW(ExpertFfn(*backend, p.x, p.counts, trained), c10::Error);
}

// ExpertFfn refuses LoRA tensors that do not fit the base weights.
TEST(ExpertFfnChecks, RejectsMismatchedLora) {
  const ExpertProblemShape shape{"bad", 4, 8, 4, 2, 1, RoutingPattern::kUniform};
  ExpertProblem p = MakeExpertProblem(shape, at::kFloat, 1);
  auto backend = Backend("eager");
  auto message = [&](const ExpertLora& lora) -> std::string {
    try {
      ExpertFfn(*backend, p.x, p.counts, {p.gate_up_proj, p.down_proj, lora});
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "";
  };
  const ExpertLora good = MakeExpertLora(shape, {.rank = 2}, at::kFloat, 2);
  EXPECT_EQ(message(good), "");
  ExpertLora bad = good;
  bad.gate_up_b = at::zeros({2, 8, 3});
  EXPECT_NE(message(bad).find("LoRA gate_up rank disagrees"), std::string::npos);
  bad = good;
  bad.down_a = at::zeros({3, 2, 4});
  EXPECT_NE(message(bad).find("experts"), std::string::npos);
  bad = good;
  bad.down_b = at::Tensor();
  EXPECT_NE(message(bad).find("must be given together"), std::string::npos);
  bad = good;
  bad.gate_up_a = good.gate_up_a.to(at::kBFloat16);
  bad.gate_up_b = good.gate_up_b.to(at::kBFloat16);
  EXPECT_NE(message(bad).find("must be float32"), std::string::npos);
  bad = good;
  bad.down_a = good.down_a.to(at::kInt);
  bad.down_b = good.down_b.to(at::kInt);
  EXPECT_NE(message(bad).find("floating dtype"), std::string::npos);
}

TEST(Registry, UnknownBackendNamesTheKnownOnes) {
  auto b = CreateExpertBackend("fast", {});
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().message(), "unknown expert backend 'fast' (known: grouped, eager)");
}

}  // namespace
}  // namespace moefit::experts
