// Fused AdamW and the gradient norm; see adamw.h.
#include "framework/adamw.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <cstring>

namespace moefit::framework {
namespace {

// Elements per task of the parallel passes: enough to amortize the dispatch.
constexpr int64_t kGrain = 1 << 15;

bool Fusable(const at::Tensor& p, const at::Tensor& g) {
  return p.device().is_cpu() && p.scalar_type() == at::kFloat && p.is_contiguous() &&
         g.device().is_cpu() && g.scalar_type() == at::kFloat && g.is_contiguous();
}

// SplitMix64's finalizer over (seed, step, tensor key, element): 16 random
// bits per element, independent of how the elements are split among threads.
inline uint32_t RandomBits16(uint64_t seed, int64_t step, uint64_t tensor, int64_t i) {
  uint64_t z = seed + static_cast<uint64_t>(step) * 0x9e3779b97f4a7c15ull +
               tensor * 0xbf58476d1ce4e5b9ull + static_cast<uint64_t>(i) * 0x94d049bb133111ebull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<uint32_t>(z >> 48);
}

// bfloat16 bits of w: to nearest even, or, with random bits r, stochastically
// (adding r below the kept 16 bits and truncating rounds the magnitude up
// with probability equal to the dropped fraction). NaN stays NaN.
inline uint16_t RoundBf16(float w, bool stochastic, uint32_t r) {
  uint32_t u;
  std::memcpy(&u, &w, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  if (stochastic) return static_cast<uint16_t>((u + r) >> 16);
  return c10::BFloat16(w).x;  // to nearest even
}

}  // namespace

FusedAdamW::FusedAdamW(std::vector<Group> groups, const AdamWHyper& hyper, bool fused)
    : groups_(std::move(groups)), hyper_(hyper), fused_(fused) {
  for (const Group& g : groups_) state_.emplace_back(g.params.size());
}

void FusedAdamW::AttachCopy(const at::Tensor& param, at::Tensor copy, uint64_t key,
                            int64_t first_element) {
  TORCH_CHECK(param.device().is_cpu() && param.scalar_type() == at::kFloat &&
                  param.is_contiguous(),
              "AttachCopy: the master must be a contiguous float32 CPU tensor");
  TORCH_CHECK(copy.device().is_cpu() && copy.scalar_type() == at::kBFloat16 &&
                  copy.is_contiguous() && copy.sizes() == param.sizes(),
              "AttachCopy: the copy must be a contiguous bfloat16 CPU tensor shaped ",
              param.sizes());
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    for (size_t pi = 0; pi < groups_[gi].params.size(); ++pi) {
      if (groups_[gi].params[pi].unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) {
        State& s = state_[gi][pi];
        s.copy = std::move(copy);
        s.key = key;
        s.first_element = first_element;
        return;
      }
    }
  }
  TORCH_CHECK(false, "AttachCopy: the tensor is not one of the optimizer's parameters");
}

void FusedAdamW::Step(double lr) {
  torch::NoGradGuard no_grad;
  const double b1 = hyper_.beta1, b2 = hyper_.beta2;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const double wd = groups_[gi].weight_decay;
    for (size_t pi = 0; pi < groups_[gi].params.size(); ++pi) {
      at::Tensor p = groups_[gi].params[pi];
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      State& s = state_[gi][pi];
      if (!s.m.defined()) {
        s.m = at::zeros_like(p, at::MemoryFormat::Contiguous);
        s.v = at::zeros_like(p, at::MemoryFormat::Contiguous);
      }
      ++s.step;
      const double bc1 = 1 - std::pow(b1, static_cast<double>(s.step));
      const double bc2 = 1 - std::pow(b2, static_cast<double>(s.step));
      const double step_size = lr / bc1;
      if (!fused_ || !Fusable(p, g)) {
        // torch.optim.AdamW's ops, as LibTorch runs them.
        if (wd != 0) p.mul_(1 - lr * wd);
        s.m.mul_(b1).add_(g, 1 - b1);
        s.v.mul_(b2).addcmul_(g, g, 1 - b2);
        at::Tensor denom = (s.v.sqrt() / std::sqrt(bc2)).add_(hyper_.eps);
        p.addcdiv_(s.m, denom, -step_size);
        if (s.copy.defined()) {
          // One element at a time: the obviously-correct rounding.
          const at::Tensor w = p.contiguous();
          const float* wp = w.const_data_ptr<float>();
          auto* cp = reinterpret_cast<uint16_t*>(s.copy.data_ptr<at::BFloat16>());
          for (int64_t i = 0; i < w.numel(); ++i) {
            cp[i] = RoundBf16(wp[i], hyper_.stochastic_rounding,
                              RandomBits16(hyper_.seed, s.step, s.key, s.first_element + i));
          }
          s.copy.unsafeGetTensorImpl()->bump_version();
        }
        continue;
      }
      float* pp = p.data_ptr<float>();
      float* mp = s.m.data_ptr<float>();
      float* vp = s.v.data_ptr<float>();
      const float* gp = g.const_data_ptr<float>();
      const float decay = static_cast<float>(1 - lr * wd);
      const float fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2);
      const float one_b1 = static_cast<float>(1 - b1), one_b2 = static_cast<float>(1 - b2);
      const float inv_sqrt_bc2 = static_cast<float>(1 / std::sqrt(bc2));
      const float eps = static_cast<float>(hyper_.eps);
      const float neg_step = static_cast<float>(-step_size);
      const bool decayed = wd != 0;
      auto* cp = s.copy.defined() ? reinterpret_cast<uint16_t*>(s.copy.data_ptr<at::BFloat16>())
                                  : nullptr;
      const bool stochastic = hyper_.stochastic_rounding;
      const uint64_t seed = hyper_.seed, key = s.key;
      const int64_t step = s.step, first = s.first_element;
      at::parallel_for(0, p.numel(), kGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const float gi_ = gp[i];
          float w = decayed ? pp[i] * decay : pp[i];
          const float m = mp[i] * fb1 + one_b1 * gi_;
          const float v = vp[i] * fb2 + one_b2 * gi_ * gi_;
          mp[i] = m;
          vp[i] = v;
          w += neg_step * m / (std::sqrt(v) * inv_sqrt_bc2 + eps);
          pp[i] = w;
        }
        if (cp == nullptr) return;
        for (int64_t i = begin; i < end; ++i) {
          cp[i] = RoundBf16(pp[i], stochastic,
                            stochastic ? RandomBits16(seed, step, key, first + i) : 0u);
        }
      });
      // Written through raw pointers: tell ATen's version counters, which
      // the expert layer's packed weights (experts/packed_weights.h) check.
      p.unsafeGetTensorImpl()->bump_version();
      if (cp != nullptr) s.copy.unsafeGetTensorImpl()->bump_version();
    }
  }
}

void FusedAdamW::ZeroGrad() {
  for (Group& g : groups_) {
    for (at::Tensor& p : g.params) p.mutable_grad() = at::Tensor();
  }
}

double SquaredNormSum(const std::vector<at::Tensor>& tensors) {
  double total = 0;
  std::vector<at::Tensor> other;
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) continue;
    const bool cpu = t.device().is_cpu() && t.is_contiguous();
    if (cpu && t.scalar_type() == at::kFloat) {
      const float* p = t.const_data_ptr<float>();
      total += at::parallel_reduce(
          0, t.numel(), kGrain, 0.0,
          [&](int64_t b, int64_t e, double acc) {
            for (int64_t i = b; i < e; ++i) acc += static_cast<double>(p[i]) * p[i];
            return acc;
          },
          std::plus<double>());
    } else if (cpu && t.scalar_type() == at::kBFloat16) {
      const c10::BFloat16* p = t.const_data_ptr<c10::BFloat16>();
      total += at::parallel_reduce(
          0, t.numel(), kGrain, 0.0,
          [&](int64_t b, int64_t e, double acc) {
            for (int64_t i = b; i < e; ++i) {
              const double x = static_cast<float>(p[i]);
              acc += x * x;
            }
            return acc;
          },
          std::plus<double>());
    } else {
      other.push_back(t.to(at::kDouble).pow(2).sum());
    }
  }
  if (!other.empty()) total += at::stack(other).sum().to(at::kCPU).item<double>();
  return total;
}

}  // namespace moefit::framework
