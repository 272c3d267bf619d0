// The fused AdamW against LibTorch's torch::optim::AdamW and against its own
// ATen twin, over several steps with weight decay on one group, parameters
// that skip a step, and tensors large enough to be split across threads; and
// the squared gradient norm against ATen in double.
#include "framework/adamw.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <limits>
#include <vector>

#include "experts/kernels/isa.h"

namespace moefit::framework {
namespace {

std::vector<at::Tensor> Params(at::Generator& gen) {
  std::vector<at::Tensor> out;
  for (int64_t n : {7, 4096, 300001}) out.push_back(at::randn({n}, gen).requires_grad_());
  out.push_back(at::randn({33, 65}, gen).requires_grad_());
  return out;
}

std::vector<at::Tensor> Clone(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : ps) out.push_back(p.detach().clone().requires_grad_());
  return out;
}

// Gradients for step `step`; parameter 0 gets none on odd steps.
void SetGrads(std::vector<at::Tensor>& ps, int step) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  for (size_t i = 0; i < ps.size(); ++i) {
    at::Tensor g = at::randn(ps[i].sizes(), gen) * 0.1;
    if (i == 0 && step % 2 == 1) continue;
    ps[i].mutable_grad() = g;
  }
}

double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

TEST(FusedAdamW, MatchesLibTorchAndItsAtenTwin) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  std::vector<at::Tensor> fused = Params(gen);
  std::vector<at::Tensor> twin = Clone(fused), ref = Clone(fused);
  const AdamWHyper h{0.9, 0.95, 1e-8};
  auto groups = [](const std::vector<at::Tensor>& ps) {
    return std::vector<FusedAdamW::Group>{{{ps[0], ps[1], ps[2]}, 0.1}, {{ps[3]}, 0.0}};
  };
  FusedAdamW opt_fused(groups(fused), h, /*fused=*/true);
  FusedAdamW opt_twin(groups(twin), h, /*fused=*/false);
  auto options = [&](double wd) {
    auto o = std::make_unique<torch::optim::AdamWOptions>(1e-3);
    o->betas({h.beta1, h.beta2}).eps(h.eps).weight_decay(wd);
    return o;
  };
  std::vector<torch::optim::OptimizerParamGroup> pg;
  pg.emplace_back(std::vector<at::Tensor>{ref[0], ref[1], ref[2]}, options(0.1));
  pg.emplace_back(std::vector<at::Tensor>{ref[3]}, options(0.0));
  torch::optim::AdamW opt_ref(pg, torch::optim::AdamWOptions(1e-3));
  for (int step = 0; step < 6; ++step) {
    const double lr = 1e-3 * (step + 1);
    opt_fused.ZeroGrad();
    opt_twin.ZeroGrad();
    opt_ref.zero_grad();
    SetGrads(fused, step);
    SetGrads(twin, step);
    SetGrads(ref, step);
    opt_fused.Step(lr);
    opt_twin.Step(lr);
    for (auto& g : opt_ref.param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    }
    opt_ref.step();
    for (size_t i = 0; i < fused.size(); ++i) {
      // The twin runs LibTorch's ops: the same numbers bit for bit.
      EXPECT_TRUE(at::equal(twin[i], ref[i])) << "param " << i << " step " << step;
      // The fused pass rounds differently: a few float32 ulps of weights of
      // order 1 (each step moves them by about lr).
      EXPECT_LT(MaxAbsDiff(fused[i], ref[i]), 2e-6) << "param " << i << " step " << step;
    }
  }
  for (size_t i = 1; i < fused.size(); ++i) EXPECT_TRUE(fused[i].grad().defined());
  opt_fused.ZeroGrad();
  for (const at::Tensor& p : fused) EXPECT_FALSE(p.grad().defined());
}

// Attached bfloat16 copies: written in the update's own pass, equal to the
// updated master rounded to nearest, in the fused pass and in its twin.
TEST(FusedAdamW, AttachedCopiesAreTheRoundedMasters) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  std::vector<at::Tensor> fused = Params(gen), twin = Clone(fused);
  FusedAdamW a({{fused, 0.1}}, {}, /*fused=*/true), b({{twin, 0.1}}, {}, /*fused=*/false);
  std::vector<at::Tensor> ca, cb;
  for (size_t i = 0; i < fused.size(); ++i) {
    ca.push_back(at::zeros(fused[i].sizes(), at::kBFloat16));
    cb.push_back(at::zeros(twin[i].sizes(), at::kBFloat16));
    a.AttachCopy(fused[i], ca[i]);
    b.AttachCopy(twin[i], cb[i]);
  }
  std::vector<int64_t> versions_before;
  for (size_t i = 0; i < fused.size(); ++i) {
    for (const at::Tensor* t : {&fused[i], &twin[i], &ca[i], &cb[i]}) {
      versions_before.push_back(t->_version());
    }
  }
  for (int step = 0; step < 3; ++step) {
    SetGrads(fused, step);
    SetGrads(twin, step);
    a.Step(1e-2);
    b.Step(1e-2);
    for (size_t i = 0; i < fused.size(); ++i) {
      EXPECT_TRUE(at::equal(ca[i], fused[i].detach().to(at::kBFloat16))) << i;
      EXPECT_TRUE(at::equal(cb[i], twin[i].detach().to(at::kBFloat16))) << i;
    }
  }
  // Each pass that wrote a tensor advanced its version counter (what the
  // expert layer's packed weights check), whether it wrote through ATen or
  // through raw pointers.
  for (size_t i = 0; i < fused.size(); ++i) {
    const int64_t steps = 3;
    const int64_t* before = &versions_before[4 * i];
    EXPECT_GE(fused[i]._version() - before[0], steps) << i;
    EXPECT_GE(twin[i]._version() - before[1], steps) << i;
    EXPECT_EQ(ca[i]._version() - before[2], steps) << i;
    EXPECT_EQ(cb[i]._version() - before[3], steps) << i;
  }
  EXPECT_THROW(a.AttachCopy(at::zeros({3}), at::zeros({3}, at::kBFloat16)), c10::Error);
}

// The fused pass's vector loop (AVX2, where the CPU has it) gives the bits of
// its scalar loop, held to it with LimitIsa: masters, moments and the
// copies rounded to nearest, at sizes that leave tails, with and without
// weight decay; NaN and infinity reach the copies as the scalar rounding
// makes them.
TEST(FusedAdamW, VectorPassGivesTheScalarBits) {
  using experts::kernels::Isa;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  std::vector<at::Tensor> vec = Params(gen), scalar = Clone(vec);
  {
    at::NoGradGuard no_grad;
    vec[3][0][0] = std::numeric_limits<float>::infinity();
    vec[3][0][1] = std::numeric_limits<float>::quiet_NaN();
    scalar[3].copy_(vec[3]);
  }
  FusedAdamW a({{{vec[0], vec[1]}, 0.1}, {{vec[2], vec[3]}, 0.0}}, {});
  FusedAdamW b({{{scalar[0], scalar[1]}, 0.1}, {{scalar[2], scalar[3]}, 0.0}}, {});
  std::vector<at::Tensor> ca, cb;
  for (size_t i = 0; i < vec.size(); ++i) {
    ca.push_back(at::zeros(vec[i].sizes(), at::kBFloat16));
    cb.push_back(at::zeros(vec[i].sizes(), at::kBFloat16));
    a.AttachCopy(vec[i], ca[i]);
    b.AttachCopy(scalar[i], cb[i]);
  }
  for (int step = 0; step < 3; ++step) {
    SetGrads(vec, step);
    SetGrads(scalar, step);
    a.Step(1e-2);
    experts::kernels::LimitIsa(Isa::kPortable);
    b.Step(1e-2);
    experts::kernels::LimitIsa(experts::kernels::DetectIsa());
    for (size_t i = 0; i < vec.size(); ++i) {
      // Bit patterns, so that NaN compares too.
      EXPECT_TRUE(at::equal(vec[i].detach().view(at::kInt), scalar[i].detach().view(at::kInt)))
          << i;
      EXPECT_TRUE(at::equal(ca[i].view(at::kShort), cb[i].view(at::kShort))) << i;
      EXPECT_TRUE(at::equal(a.tensor_state(i / 2, i % 2).m, b.tensor_state(i / 2, i % 2).m)) << i;
      EXPECT_TRUE(at::equal(a.tensor_state(i / 2, i % 2).v, b.tensor_state(i / 2, i % 2).v)) << i;
    }
  }
}

// Stochastic rounding: a master a quarter of a bfloat16 step above 1 rounds
// up in about a quarter of the elements (down otherwise), negative values
// alike; the bits do not depend on the thread count or on how a tensor is
// split (first_element), and the twin draws the same ones.
TEST(FusedAdamW, StochasticRoundingIsUnbiasedAndReproducible) {
  constexpr int64_t n = 200000;
  const float up = 1.0f + 0.0078125f;  // 1 + 2^-7: one bfloat16 step above 1
  at::Tensor values = at::full({n}, 1.0f + 0.25f * 0.0078125f);
  values.narrow(0, n / 2, n / 2).neg_();
  const int saved_threads = at::get_num_threads();
  auto run = [&](bool fused, int threads, bool split) {
    at::set_num_threads(threads);
    std::vector<at::Tensor> params, copies;
    std::vector<int64_t> firsts;
    const int64_t parts = split ? 2 : 1;
    for (int64_t p = 0; p < parts; ++p) {
      params.push_back(values.narrow(0, p * n / parts, n / parts).clone().requires_grad_());
      copies.push_back(at::zeros({n / parts}, at::kBFloat16));
      firsts.push_back(p * n / parts);
    }
    FusedAdamW opt({{params, 0.0}}, {.stochastic_rounding = true, .seed = 7}, fused);
    for (size_t p = 0; p < params.size(); ++p) {
      opt.AttachCopy(params[p], copies[p], /*key=*/42, firsts[p]);
      params[p].mutable_grad() = at::zeros({n / parts});  // no update: only the rounding
    }
    opt.Step(1e-3);
    at::set_num_threads(saved_threads);
    return at::cat(copies).to(at::kFloat);
  };
  const at::Tensor c = run(true, 2, false);
  const double frac_up_pos = c.narrow(0, 0, n / 2).eq(up).sum().item<double>() / (n / 2);
  const double frac_up_neg = c.narrow(0, n / 2, n / 2).eq(-up).sum().item<double>() / (n / 2);
  EXPECT_NEAR(frac_up_pos, 0.25, 0.01);
  EXPECT_NEAR(frac_up_neg, 0.25, 0.01);
  EXPECT_TRUE(at::logical_or(c.abs().eq(1.0f), c.abs().eq(up)).all().item<bool>());
  EXPECT_TRUE(at::equal(c, run(true, 1, false)));
  EXPECT_TRUE(at::equal(c, run(true, 2, true)));  // split in two tensors
  EXPECT_TRUE(at::equal(c, run(false, 1, false)));
}

TEST(SquaredNormSum, EqualsAtenInDouble) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(2);
  std::vector<at::Tensor> ts = {at::randn({300001}, gen), at::randn({17, 3}, gen).t(),
                                at::randn({4097}, gen).to(at::kBFloat16), at::Tensor(),
                                at::randn({5}, gen, at::kDouble)};
  double want = 0;
  for (const at::Tensor& t : ts) {
    if (t.defined()) want += t.to(at::kDouble).pow(2).sum().item<double>();
  }
  EXPECT_NEAR(SquaredNormSum(ts), want, 1e-9 * want);
}

}  // namespace
}  // namespace moefit::framework
