// The fused AdamW against LibTorch's torch::optim::AdamW and against its own
// ATen twin, over several steps with weight decay on one group, parameters
// that skip a step, and tensors large enough to be split across threads; and
// the squared gradient norm against ATen in double.
#include "framework/adamw.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <vector>

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
