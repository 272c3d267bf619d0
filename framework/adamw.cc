// Fused AdamW and the gradient norm; see adamw.h.
#include "framework/adamw.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <cstring>

#include "experts/kernels/isa.h"

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

// One tensor's fused update: its pointers and the step's constants.
struct Update {
  float* p;
  float* m;
  float* v;
  const float* g;
  uint16_t* copy;  // null: no attached copy
  float decay, b1, b2, one_b1, one_b2, inv_sqrt_bc2, eps, neg_step;
  bool decayed;
};

// Elements [begin, end) of the update, one at a time.
inline void UpdateScalar(const Update& u, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float gi_ = u.g[i];
    float w = u.decayed ? u.p[i] * u.decay : u.p[i];
    const float m = u.m[i] * u.b1 + u.one_b1 * gi_;
    const float v = u.v[i] * u.b2 + u.one_b2 * gi_ * gi_;
    u.m[i] = m;
    u.v[i] = v;
    w += u.neg_step * m / (std::sqrt(v) * u.inv_sqrt_bc2 + u.eps);
    u.p[i] = w;
  }
}

// The same eight elements at a time with AVX2, and the copy rounded to
// nearest even in the same pass: the scalar loop's operations in its order,
// each rounded once (no FMA contraction: the target has no FMA), so the same
// bits. Returns the first element left for the scalar loop.
__attribute__((target("avx2"))) int64_t UpdateAvx2(const Update& u, int64_t begin, int64_t end) {
  const __m256 decay = _mm256_set1_ps(u.decay), b1 = _mm256_set1_ps(u.b1);
  const __m256 b2 = _mm256_set1_ps(u.b2), one_b1 = _mm256_set1_ps(u.one_b1);
  const __m256 one_b2 = _mm256_set1_ps(u.one_b2), inv = _mm256_set1_ps(u.inv_sqrt_bc2);
  const __m256 eps = _mm256_set1_ps(u.eps), neg_step = _mm256_set1_ps(u.neg_step);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
  const __m256i quiet = _mm256_set1_epi32(0x40);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 g = _mm256_loadu_ps(u.g + i);
    __m256 w = _mm256_loadu_ps(u.p + i);
    if (u.decayed) w = _mm256_mul_ps(w, decay);
    const __m256 m =
        _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(u.m + i), b1), _mm256_mul_ps(one_b1, g));
    const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(u.v + i), b2),
                                   _mm256_mul_ps(_mm256_mul_ps(one_b2, g), g));
    _mm256_storeu_ps(u.m + i, m);
    _mm256_storeu_ps(u.v + i, v);
    const __m256 den = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), inv), eps);
    w = _mm256_add_ps(w, _mm256_div_ps(_mm256_mul_ps(neg_step, m), den));
    _mm256_storeu_ps(u.p + i, w);
    if (u.copy != nullptr) {
      // RoundBf16 without stochastic rounding, lane by lane.
      const __m256i bits = _mm256_castps_si256(w);
      const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, abs_mask), inf);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
      const __m256i rounded =
          _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(bias, lsb)), 16);
      const __m256i nan_bits = _mm256_or_si256(_mm256_srli_epi32(bits, 16), quiet);
      const __m256i out = _mm256_blendv_epi8(rounded, nan_bits, nan);
      // 16-bit halves of the eight lanes, in order.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(out, out), 0x08);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(u.copy + i), _mm256_castsi256_si128(packed));
    }
  }
  return i;
}

// The sum of p[i]^2 over [b, e) in double, in kLanes independent partial sums
// (one long chain of dependent additions would run at one element per
// floating-point add latency, several times below memory speed).
template <typename T>
double SumOfSquares(const T* p, int64_t b, int64_t e) {
  constexpr int kLanes = 8;
  double lane[kLanes] = {};
  int64_t i = b;
  for (; i + kLanes <= e; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const double x = static_cast<float>(p[i + l]);
      lane[l] += x * x;
    }
  }
  double sum = 0;
  for (; i < e; ++i) {
    const double x = static_cast<float>(p[i]);
    sum += x * x;
  }
  for (int l = 0; l < kLanes; ++l) sum += lane[l];
  return sum;
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
      Update u;
      u.p = p.data_ptr<float>();
      u.m = s.m.data_ptr<float>();
      u.v = s.v.data_ptr<float>();
      u.g = g.const_data_ptr<float>();
      u.decay = static_cast<float>(1 - lr * wd);
      u.b1 = static_cast<float>(b1);
      u.b2 = static_cast<float>(b2);
      u.one_b1 = static_cast<float>(1 - b1);
      u.one_b2 = static_cast<float>(1 - b2);
      u.inv_sqrt_bc2 = static_cast<float>(1 / std::sqrt(bc2));
      u.eps = static_cast<float>(hyper_.eps);
      u.neg_step = static_cast<float>(-step_size);
      u.decayed = wd != 0;
      auto* cp = s.copy.defined() ? reinterpret_cast<uint16_t*>(s.copy.data_ptr<at::BFloat16>())
                                  : nullptr;
      const bool stochastic = hyper_.stochastic_rounding;
      // The vector pass writes the copy too, unless its rounding is
      // stochastic (random bits per element: the scalar loop's).
      u.copy = stochastic ? nullptr : cp;
      const bool avx2 = static_cast<int>(experts::kernels::ActiveIsa()) >=
                        static_cast<int>(experts::kernels::Isa::kAvx2);
      const uint64_t seed = hyper_.seed, key = s.key;
      const int64_t step = s.step, first = s.first_element;
      const float* pp = u.p;
      at::parallel_for(0, p.numel(), kGrain, [&](int64_t begin, int64_t end) {
        const int64_t vector_end = avx2 ? UpdateAvx2(u, begin, end) : begin;
        UpdateScalar(u, vector_end, end);
        if (cp == nullptr) return;
        for (int64_t i = stochastic ? begin : vector_end; i < end; ++i) {
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
          [&](int64_t b, int64_t e, double acc) { return acc + SumOfSquares(p, b, e); },
          std::plus<double>());
    } else if (cpu && t.scalar_type() == at::kBFloat16) {
      const c10::BFloat16* p = t.const_data_ptr<c10::BFloat16>();
      total += at::parallel_reduce(
          0, t.numel(), kGrain, 0.0,
          [&](int64_t b, int64_t e, double acc) { return acc + SumOfSquares(p, b, e); },
          std::plus<double>());
    } else {
      other.push_back(t.to(at::kDouble).pow(2).sum());
    }
  }
  if (!other.empty()) total += at::stack(other).sum().to(at::kCPU).item<double>();
  return total;
}

}  // namespace moefit::framework
