// A dense layer's linear map on the CPU, forward and backward: moefit's
// (framework/cpu_linear.h, on moefit's GEMM) against at::linear (MKL) on the
// same float32 tensors in the same run, in interleaved rounds; the median
// milliseconds of each and the ratio at::linear / moefit (> 1: moefit
// faster), with a trained weight (input and weight gradients) and a frozen
// one (input gradient only, as under LoRA), and the CPU flags.
//
// Shapes (default: the e2e qwen3_moe step's projections, 8 x 256 tokens of
// hidden 512; N = 512 for q and o, 256 for k, v and the LM head):
// --tokens=2048 --in=512 --out=512,256 --rounds=15
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "experts/kernels/isa.h"
#include "framework/cpu_linear.h"

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<int64_t> ParseList(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::atoll(item.c_str()));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 2048, in_features = 512, rounds = 15;
  std::vector<int64_t> outs = {512, 256};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      const std::string f = std::string("--") + flag + "=";
      return a.rfind(f, 0) == 0 ? argv[i] + f.size() : nullptr;
    };
    if (const char* v = value("tokens")) {
      tokens = std::atoll(v);
    } else if (const char* v = value("in")) {
      in_features = std::atoll(v);
    } else if (const char* v = value("out")) {
      outs = ParseList(v);
    } else if (const char* v = value("rounds")) {
      rounds = std::atoll(v);
    } else {
      std::fprintf(stderr, "usage: linear_bench [--tokens=2048 --in=512 --out=512,256 --rounds=15]\n");
      return 2;
    }
  }
  if (tokens < 1 || in_features < 1 || rounds < 1 || outs.empty()) {
    std::fprintf(stderr, "linear_bench: sizes and rounds must be positive\n");
    return 2;
  }
  std::printf("linear forward + backward, %ld tokens x %ld in, float32, %d threads, CPU flags: %s\n",
              static_cast<long>(tokens), static_cast<long>(in_features), at::get_num_threads(),
              moefit::experts::kernels::CpuFlags().c_str());
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);
  const at::Tensor x = at::randn({tokens, in_features}, gen);
  for (const int64_t out : outs) {
    const at::Tensor w = at::randn({out, in_features}, gen) * 0.05;
    const at::Tensor grad = at::randn({tokens, out}, gen);
    for (const bool trained : {true, false}) {
      auto time_one = [&](bool ours) {
        const at::Tensor xl = x.detach().requires_grad_(true);
        const at::Tensor wl = w.detach().requires_grad_(trained);
        const auto t0 = std::chrono::steady_clock::now();
        at::Tensor y = ours ? moefit::framework::CpuLinear(xl, wl) : at::linear(xl, wl);
        y.backward(grad);
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() *
               1e3;
      };
      time_one(true);  // warm-up
      time_one(false);
      std::vector<double> ours, theirs;
      for (int64_t r = 0; r < rounds; ++r) {
        ours.push_back(time_one(true));
        theirs.push_back(time_one(false));
      }
      const double m_ours = Median(ours), m_theirs = Median(theirs);
      const double gflop = 2.0 * tokens * in_features * out * (trained ? 3 : 2) / 1e9;
      std::printf("  out %5ld, %-14s at::linear %7.2f ms (%5.1f GFLOP/s)  moefit %7.2f ms (%5.1f "
                  "GFLOP/s)  ratio %.2f\n",
                  static_cast<long>(out), trained ? "trained weight" : "frozen weight", m_theirs,
                  gflop / m_theirs * 1e3, m_ours, gflop / m_ours * 1e3, m_theirs / m_ours);
    }
  }
  return 0;
}
