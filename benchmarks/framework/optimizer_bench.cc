// One AdamW step over many parameters: the fused pass (framework/adamw.h)
// against LibTorch's torch::optim::AdamW on the same tensors in the same run,
// plus zeroing the gradients and the squared gradient norm each way (LibTorch:
// zero_grad and the sum of each gradient widened to double). Reported as
// seconds per step and the ratio fused / LibTorch.
//
// Shape (default: the routed experts of a qwen3_moe layer stack of 4 layers x
// 32 experts of hidden 512 and intermediate 512, 100M parameters, as 8
// tensors): --params_m=100 --tensors=8 --steps=5
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "framework/adamw.h"

namespace {

double Seconds(const std::chrono::steady_clock::time_point& start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  int64_t params_m = 100, tensors = 8, steps = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      const std::string f = std::string("--") + flag + "=";
      return a.rfind(f, 0) == 0 ? argv[i] + f.size() : nullptr;
    };
    if (const char* v = value("params_m")) {
      params_m = std::atoll(v);
    } else if (const char* v = value("tensors")) {
      tensors = std::atoll(v);
    } else if (const char* v = value("steps")) {
      steps = std::atoll(v);
    } else {
      std::fprintf(stderr, "usage: optimizer_bench [--params_m=100 --tensors=8 --steps=5]\n");
      return 2;
    }
  }
  const int64_t per_tensor = params_m * 1'000'000 / tensors;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);
  std::vector<at::Tensor> a, b;
  for (int64_t t = 0; t < tensors; ++t) {
    a.push_back((at::randn({per_tensor}, gen) * 0.02).requires_grad_());
    b.push_back(a.back().detach().clone().requires_grad_());
  }
  moefit::framework::FusedAdamW fused({{a, 0.1}}, {0.9, 0.95, 1e-8});
  auto opts = std::make_unique<torch::optim::AdamWOptions>(1e-4);
  opts->betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(b, std::move(opts));
  torch::optim::AdamW libtorch(groups, torch::optim::AdamWOptions(1e-4));

  double t_fused = 0, t_libtorch = 0;
  for (int64_t s = 0; s <= steps; ++s) {
    for (int64_t t = 0; t < tensors; ++t) {
      at::Tensor g = at::randn({per_tensor}, gen) * 1e-3;
      a[t].mutable_grad() = g;
      b[t].mutable_grad() = g.clone();
    }
    auto start = std::chrono::steady_clock::now();
    const double norm_fused = moefit::framework::SquaredNormSum([&] {
      std::vector<at::Tensor> g;
      for (const at::Tensor& p : a) g.push_back(p.grad());
      return g;
    }());
    fused.Step(1e-4);
    fused.ZeroGrad();
    const double dt_fused = Seconds(start);
    start = std::chrono::steady_clock::now();
    std::vector<at::Tensor> sums;
    for (const at::Tensor& p : b) sums.push_back(p.grad().to(at::kDouble).pow(2).sum());
    const double norm_libtorch = at::stack(sums).sum().item<double>();
    libtorch.step();
    libtorch.zero_grad();
    const double dt_libtorch = Seconds(start);
    if (std::abs(norm_fused - norm_libtorch) > 1e-9 * norm_libtorch) {
      std::fprintf(stderr, "gradient norms differ: %.17g vs %.17g\n", norm_fused, norm_libtorch);
      return 1;
    }
    if (s > 0) {  // the first step allocates m and v
      t_fused += dt_fused;
      t_libtorch += dt_libtorch;
    }
  }
  std::printf(
      "AdamW step + gradient norm + zeroing over %lldM fp32 parameters in %lld tensors, %d "
      "threads:\n  LibTorch %.3f s  fused %.3f s  fused / LibTorch %.2f\n",
      static_cast<long long>(params_m), static_cast<long long>(tensors), at::get_num_threads(),
      t_libtorch / steps, t_fused / steps, t_fused / t_libtorch);
  return 0;
}
