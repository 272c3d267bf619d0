// Causal self-attention forward and backward on the CPU: moefit's kernel
// (framework/causal_attention.h) against LibTorch's SDPA (its CPU flash
// kernel, is_causal) on the same float32 tensors in the same run, the GQA
// key-value heads repeated for SDPA as the model repeats them where it calls
// SDPA. Interleaved rounds; reports the
// median milliseconds of each and the ratio SDPA / moefit (> 1: moefit
// faster), with the CPU flags and the thread count.
//
// Shape (default: the e2e qwen3_moe layer, 8 sequences of 256 tokens, 8 query
// and 4 key-value heads of 64): --batch=8 --heads=8 --kv_heads=4 --seq=256
// --head_dim=64 --rounds=15
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "experts/kernels/isa.h"
#include "framework/causal_attention.h"

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t batch = 8, heads = 8, kv_heads = 4, seq = 256, head_dim = 64, rounds = 15;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto take = [&](const char* flag, int64_t* out) {
      const std::string f = std::string("--") + flag + "=";
      if (a.rfind(f, 0) != 0) return false;
      *out = std::atoll(argv[i] + f.size());
      return true;
    };
    if (!take("batch", &batch) && !take("heads", &heads) && !take("kv_heads", &kv_heads) &&
        !take("seq", &seq) && !take("head_dim", &head_dim) && !take("rounds", &rounds)) {
      std::fprintf(stderr,
                   "usage: attention_bench [--batch=8 --heads=8 --kv_heads=4 --seq=256 "
                   "--head_dim=64 --rounds=15]\n");
      return 2;
    }
  }
  if (kv_heads < 1 || heads % kv_heads != 0 || rounds < 1) {
    std::fprintf(stderr, "attention_bench: heads must be a multiple of kv_heads >= 1\n");
    return 2;
  }
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);
  // As the model lays them out: [B, T, heads, d] viewed [B, heads, T, d].
  const at::Tensor q = at::randn({batch, seq, heads, head_dim}, gen).transpose(1, 2);
  const at::Tensor k = at::randn({batch, seq, kv_heads, head_dim}, gen).transpose(1, 2);
  const at::Tensor v = at::randn({batch, seq, kv_heads, head_dim}, gen).transpose(1, 2);
  const at::Tensor grad = at::randn({batch, heads, seq, head_dim}, gen);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const int64_t groups = heads / kv_heads;

  auto time_one = [&](bool ours) {
    const at::Tensor ql = q.detach().requires_grad_(true);
    const at::Tensor kl = k.detach().requires_grad_(true);
    const at::Tensor vl = v.detach().requires_grad_(true);
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor out;
    if (ours) {
      out = moefit::framework::CausalAttention(ql, kl, vl, scale);
    } else {
      at::Tensor kr = groups > 1 ? kl.repeat_interleave(groups, 1) : kl;
      at::Tensor vr = groups > 1 ? vl.repeat_interleave(groups, 1) : vl;
      out = at::scaled_dot_product_attention(ql, kr, vr, {}, 0.0, /*is_causal=*/true, scale);
    }
    out.backward(grad);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3;
  };
  time_one(true);  // warm-up: allocator, thread pool
  time_one(false);
  std::vector<double> ours, sdpa;
  for (int64_t r = 0; r < rounds; ++r) {
    ours.push_back(time_one(true));
    sdpa.push_back(time_one(false));
  }
  const double flops = 4.0 * batch * heads * seq * seq * head_dim;  // two products, full square
  const double m_ours = Median(ours), m_sdpa = Median(sdpa);
  std::printf(
      "causal attention forward + backward, B %ld, heads %ld/%ld kv, T %ld, d %ld, %d "
      "threads, CPU flags: %s\n",
      static_cast<long>(batch), static_cast<long>(heads), static_cast<long>(kv_heads),
      static_cast<long>(seq), static_cast<long>(head_dim), at::get_num_threads(),
      moefit::experts::kernels::CpuFlags().c_str());
  std::printf("  SDPA (flash, is_causal)   %8.2f ms\n", m_sdpa);
  std::printf("  moefit CausalAttention    %8.2f ms\n", m_ours);
  std::printf("  ratio SDPA / moefit: %.2f  (forward's full-square GFLOP: %.2f)\n", m_sdpa / m_ours,
              flops / 1e9);
  return 0;
}
