// Forward + backward of one routed-expert layer for each backend and dtype,
// beside one large GEMM with the same FLOPs run in the same process (the
// machine's practical ceiling). Timing claims are ratios to that ceiling,
// measured in the same run, because the machines are shared and noisy.
//
// Shape (defaults near a Qwen3-30B-A3B layer): --tokens=1024 --hidden=2048
// --inter=768 --experts=32 --top_k=8, routing uniform or --pattern=skewed
// (Zipf-like: a few hot experts); the problems are the ones the backend tests
// check (tests/support/expert_problem.h).
//
// LoRA: forward + backward of the same layer on the `grouped` backend with
// rank --lora_rank=8 adapters on both projections and a frozen base (no base
// weight gradients), with saved and with recomputed activations, against full
// fine-tuning (base weight gradients, no adapters), all three timed in turn in
// each iteration; reported as ratios to the full step. These use
// --lora_tokens=512 tokens (the other dimensions as above) so that the default
// run stays short. The full step's weights (a copy of the base, changed every
// iteration) are packed per call; the frozen base is kept packed within
// --lora_packed_mb=2048 MiB (as experts.packed_weight_gb).
//
// Where the kernels run avx512_bf16, bfloat16 and FP8 layers are timed again
// in the form of its blocked path that this CPU did not choose (bfloat16
// pairs or widened to float32, experts/kernels/isa.h), suffixed _pairs or
// _widened.
//
// Rows read by index: the backward's sum of each token's top_k expert-row
// gradients (experts::internal::SumCopies) against LibTorch's index_add of
// the same rows, in GB/s (copies/ lines).
//
// Host memory: the expert layers run on moefit's caching host allocator, as
// `moefit train` runs them (framework/host_allocator.h); --host_allocator=system
// takes LibTorch's default, which maps and clears fresh pages for every large
// activation and gradient of every iteration. The GEMM's operands always come
// from LibTorch's default (see BM_Gemm).
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <tuple>

#include "experts/expert_function.h"
#include "tests/support/expert_problem.h"
#include "experts/kernels/internal/bf16_pairs.h"
#include "experts/kernels/isa.h"
#include "experts/registry.h"
#include "framework/host_allocator.h"

namespace moefit::experts {
namespace {

bool g_caching_allocator = true;
ExpertProblemShape g_shape{"layer", 1024, 2048, 768, 32, 8, RoutingPattern::kUniform};
int64_t g_lora_rank = 8;
int64_t g_lora_tokens = 512;
// The LoRA step's budget of kept packs, MiB (BackendOptions::packed_weight_bytes).
int64_t g_lora_packed_mb = 2048;
// Reports `flops` per iteration as a GFLOP/s rate.
void Record(benchmark::State& state, double flops) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// What an optimizer step does to the base weights as far as the backends can
// tell (FusedAdamW bumps the version counters of what it writes).
void BumpVersions(const ExpertWeights& w) {
  w.gate_up_proj.unsafeGetTensorImpl()->bump_version();
  w.down_proj.unsafeGetTensorImpl()->bump_version();
}

// dtype float8_e4m3fn: frozen FP8 weights (block-quantized from the float32
// ones) with bfloat16 activations, forward + dX only (no weight gradients), so
// two forwards' FLOPs. bf16_pairs holds avx512_bf16 to one form while it runs.
void BM_ExpertLayer(benchmark::State& state, std::string backend_name, at::ScalarType dtype,
                    BackendOptions options, std::optional<bool> bf16_pairs) {
  const bool fp8 = dtype == at::kFloat8_e4m3fn;
  ExpertProblem p = MakeExpertProblem(g_shape, fp8 ? at::kBFloat16 : dtype, 0);
  ExpertWeights w{p.gate_up_proj, p.down_proj};
  if (fp8) w = QuantizeFp8(p);
  auto backend = CreateExpertBackend(backend_name, options);
  if (!backend.ok()) {
    state.SkipWithError(std::string(backend.status().message()).c_str());
    return;
  }
  kernels::internal::SetBf16Pairs(bf16_pairs);
  auto step = [&] {
    // Trainable weights change at every optimizer step: their packed copies
    // (experts/packed_weights.h) are made again in each iteration. Frozen
    // FP8 ones are packed once.
    if (!fp8) BumpVersions(w);
    at::Tensor act;
    at::Tensor y = (*backend)->Forward(p.x, p.counts, w, &act);
    ExpertGrads g =
        (*backend)->Backward(p.grad_y, p.x, p.counts, w, act, {.base_weight_grads = !fp8});
    benchmark::DoNotOptimize(g.x.data_ptr());
  };
  // Untimed, as a training run's first steps: the buffers' first touch, and
  // for a frozen weight the steps before its packs are kept (from its second
  // use on), so that the timed steps are the ones that follow.
  for (int i = 0; i < (fp8 ? 2 : 1); ++i) step();
  for (auto _ : state) step();
  Record(state, (fp8 ? 2.0 : 3.0) * ExpertForwardFlops(g_shape));
  kernels::internal::SetBf16Pairs(std::nullopt);
}

// Full fine-tuning vs LoRA on a frozen base, see the top of the file. The
// iteration time is the sum of the three steps; the counters give each step's
// mean time and the ratios to the full step.
void BM_LoraStep(benchmark::State& state, at::ScalarType dtype) {
  ExpertProblemShape shape = g_shape;
  shape.num_tokens = g_lora_tokens;
  ExpertProblem p = MakeExpertProblem(shape, dtype, 0);
  const ExpertLora lora = MakeExpertLora(shape, {.rank = g_lora_rank}, at::kFloat, 1);
  auto backend = CreateExpertBackend("grouped", {.packed_weight_bytes = g_lora_packed_mb << 20});
  if (!backend.ok()) {
    state.SkipWithError(std::string(backend.status().message()).c_str());
    return;
  }
  // Full fine-tuning updates its own copy of the base at every step (so its
  // packs are made again each time); the frozen base of LoRA stays packed.
  const ExpertWeights full{p.gate_up_proj.clone(), p.down_proj.clone()};
  const ExpertWeights with_lora{p.gate_up_proj, p.down_proj, lora};
  // Seconds of one forward + backward.
  auto step = [&](const ExpertWeights& w, bool base_weight_grads, bool recompute) {
    const auto start = std::chrono::steady_clock::now();
    at::Tensor act;
    at::Tensor y = (*backend)->Forward(p.x, p.counts, w, recompute ? nullptr : &act);
    ExpertGrads g = (*backend)->Backward(p.grad_y, p.x, p.counts, w, act,
                                         {.base_weight_grads = base_weight_grads});
    benchmark::DoNotOptimize(g.x.data_ptr());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  // Untimed, as a training run's first steps: the buffers' first touch, and
  // the frozen base's packs, made on its second use and kept from then on
  // (timing that step would count packing every expert whole once per three
  // iterations).
  step(full, true, false);
  step(with_lora, false, false);
  step(with_lora, false, false);
  double full_s = 0, lora_s = 0, recompute_s = 0;
  for (auto _ : state) {
    BumpVersions(full);
    const double f = step(full, true, false);
    const double l = step(with_lora, false, false);
    const double r = step(with_lora, false, true);
    full_s += f;
    lora_s += l;
    recompute_s += r;
    state.SetIterationTime(f + l + r);
  }
  state.counters["full_ms"] = benchmark::Counter(full_s * 1e3, benchmark::Counter::kAvgIterations);
  state.counters["lora_ms"] = benchmark::Counter(lora_s * 1e3, benchmark::Counter::kAvgIterations);
  state.counters["lora_recompute_ms"] =
      benchmark::Counter(recompute_s * 1e3, benchmark::Counter::kAvgIterations);
  state.counters["lora/full"] = lora_s / full_s;
  state.counters["lora_recompute/full"] = recompute_s / full_s;
}

// One [M, K] x [K, N] GEMM with the FLOPs of forward + backward of the layer.
void BM_Gemm(benchmark::State& state, at::ScalarType dtype) {
  const double flops = 3.0 * ExpertForwardFlops(g_shape);
  const int64_t n = 2048, k = 2048;
  const int64_t m = static_cast<int64_t>(std::llround(flops / (2.0 * n * k)));
  // The ceiling's operands from LibTorch's default allocator whichever the
  // experts run on: on the machine measured, this GEMM (operands of a few
  // hundred MB) ran about a third slower in the caching allocator's
  // huge-page-advised blocks, and a ceiling measured low would flatter the
  // ratios.
  framework::UseCachingHostAllocator(false);
  at::Tensor a = at::randn({m, k}).to(dtype), b = at::randn({k, n}).to(dtype);
  at::Tensor c = at::empty({m, n}, a.options());
  framework::UseCachingHostAllocator(g_caching_allocator);
  for (auto _ : state) {
    at::mm_out(c, a, b);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  Record(state, 2.0 * m * n * k);
}

// The backward of rows read by index (ExpertFfnOptions::row_index): each
// token's row gets the sum of its top_k computation rows' gradients, which
// lie in expert order. Ours (internal::SumCopies) against LibTorch's
// index_add of the same rows (what autograd gives for rows copied out with
// index_select), float32; GB/s of rows read and written.
void BM_SumCopies(benchmark::State& state, bool ours) {
  const int64_t tokens = g_shape.num_tokens, k = g_shape.top_k, h = g_shape.hidden;
  at::Tensor slots = std::get<1>(at::rand({tokens, g_shape.num_experts}).topk(k, 1)).reshape(-1);
  // Computation row a holds slot order[a]: the slots sorted by expert.
  at::Tensor order = std::get<1>(at::sort(slots, std::optional<bool>(true), 0, false));
  at::Tensor row_of_slot = at::empty_like(order);
  row_of_slot.index_put_({order}, at::arange(order.numel()));
  const at::Tensor copies = row_of_slot.view({tokens, k}).contiguous();
  const at::Tensor token_of_row = at::div(order, k, "floor");
  const at::Tensor per_row = at::randn({tokens * k, h});
  for (auto _ : state) {
    at::Tensor out = ours ? internal::SumCopies(per_row, copies)
                          : at::zeros({tokens, h}).index_add_(0, token_of_row, per_row);
    benchmark::DoNotOptimize(out.data_ptr());
  }
  const double bytes = static_cast<double>((tokens * k + tokens) * h) * sizeof(float);
  state.counters["GB/s"] =
      benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

class TableReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      auto it = r.counters.find("GFLOP/s");
      std::string name = r.benchmark_name();
      name = name.substr(0, std::min(name.find("/min_time"), name.find("/iterations")));
      if (it != r.counters.end()) rates_[name] = it->second.value;
      if (r.counters.count("GB/s")) copies_[name] = r.counters.at("GB/s").value;
      if (r.counters.count("lora/full")) lora_[name] = r.counters;
    }
  }
  void PrintTable() const {
    std::printf("\nexpert layer fwd+bwd, tokens=%ld hidden=%ld inter=%ld experts=%ld top_k=%ld %s\n",
                (long)g_shape.num_tokens, (long)g_shape.hidden, (long)g_shape.intermediate,
                (long)g_shape.num_experts, (long)g_shape.top_k,
                g_shape.pattern == moefit::experts::RoutingPattern::kSkewed ? "skewed" : "uniform");
    std::printf("CPU flags: %s; expert kernels: %s; host allocator: %s\n",
                kernels::CpuFlags().c_str(), kernels::IsaDescription(kernels::ActiveIsa()).c_str(),
                g_caching_allocator ? "caching" : "system");
    std::printf("%-38s %10s %14s\n", "benchmark", "GFLOP/s", "vs fp32 GEMM");
    for (const auto& [name, rate] : rates_) {
      auto ceiling = rates_.find("gemm/fp32");
      std::printf("%-38s %10.1f %14.2f\n", name.c_str(), rate,
                  ceiling != rates_.end() && ceiling->second > 0 ? rate / ceiling->second : 0.0);
    }
    if (copies_.size() == 2) {
      std::printf(
          "\nbackward of rows read by index (sum of each token's %ld expert rows, float32): "
          "%.1f GB/s, LibTorch index_add %.1f GB/s, ratio %.2f\n",
          (long)g_shape.top_k, copies_.at("copies/ours"), copies_.at("copies/index_add"),
          copies_.at("copies/ours") / copies_.at("copies/index_add"));
    }
    if (lora_.empty()) return;
    std::printf(
        "\ngrouped fwd+bwd, LoRA rank %ld on a frozen base vs full fine-tuning, tokens=%ld\n",
        (long)g_lora_rank, (long)g_lora_tokens);
    std::printf("%-16s %10s %10s %10s %18s %20s\n", "benchmark", "full ms", "lora ms", "lora/full",
                "lora+recompute ms", "lora+recompute/full");
    for (const auto& [name, c] : lora_) {
      std::printf("%-16s %10.1f %10.1f %10.2f %18.1f %20.2f\n", name.c_str(), c.at("full_ms").value,
                  c.at("lora_ms").value, c.at("lora/full").value, c.at("lora_recompute_ms").value,
                  c.at("lora_recompute/full").value);
    }
  }

 private:
  std::map<std::string, double> rates_;
  std::map<std::string, benchmark::UserCounters> lora_;  // the LoRA benchmarks' counters
  std::map<std::string, double> copies_;                 // GB/s of the copies/ benchmarks
};

}  // namespace
}  // namespace moefit::experts

int main(int argc, char** argv) {
  using moefit::experts::g_shape;
  // Shape flags (ours), then Google Benchmark's own.
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    auto take = [&](const char* flag, int64_t* out) {
      const size_t n = std::strlen(flag);
      if (std::strncmp(argv[i], flag, n) == 0 && argv[i][n] == '=') {
        *out = std::atoll(argv[i] + n + 1);
        return true;
      }
      return false;
    };
    if (std::strcmp(argv[i], "--host_allocator=system") == 0) {
      moefit::experts::g_caching_allocator = false;
      continue;
    }
    if (std::strcmp(argv[i], "--host_allocator=caching") == 0) continue;
    if (std::strcmp(argv[i], "--pattern=skewed") == 0) {
      g_shape.pattern = moefit::experts::RoutingPattern::kSkewed;
      continue;
    }
    if (take("--tokens", &g_shape.num_tokens) || take("--hidden", &g_shape.hidden) ||
        take("--inter", &g_shape.intermediate) || take("--experts", &g_shape.num_experts) ||
        take("--top_k", &g_shape.top_k) || take("--lora_rank", &moefit::experts::g_lora_rank) ||
        take("--lora_tokens", &moefit::experts::g_lora_tokens) ||
        take("--lora_packed_mb", &moefit::experts::g_lora_packed_mb)) {
      continue;
    }
    rest.push_back(argv[i]);
  }
  moefit::framework::UseCachingHostAllocator(moefit::experts::g_caching_allocator);
  int rest_argc = static_cast<int>(rest.size());
  // eager runs LibTorch's per-expert mm: float32 only (its bfloat16 mm has
  // no fast kernel on CPUs without AVX-512 BF16).
  const std::tuple<const char*, at::ScalarType, const char*> layers[] = {
      {"eager", at::kFloat, "fp32"},
      {"grouped", at::kFloat, "fp32"},
      {"grouped", at::kBFloat16, "bf16"},
      {"grouped", at::kFloat8_e4m3fn, "fp8_frozen"}};
  for (auto [backend, dtype, dname] : layers) {
    benchmark::RegisterBenchmark((std::string("experts/") + backend + "/" + dname).c_str(),
                                 moefit::experts::BM_ExpertLayer, std::string(backend), dtype,
                                 moefit::experts::BackendOptions{}, std::nullopt)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->MinTime(1.0);
  }
  namespace kernels = moefit::experts::kernels;
  if (kernels::ActiveIsa() == kernels::Isa::kAvx512Bf16) {
    const bool other = !kernels::MultipliesBf16Pairs(kernels::Isa::kAvx512Bf16);
    for (auto [dtype, dname] :
         {std::pair{at::kBFloat16, "bf16"}, std::pair{at::kFloat8_e4m3fn, "fp8_frozen"}}) {
      benchmark::RegisterBenchmark(
          (std::string("experts/grouped/") + dname + (other ? "_pairs" : "_widened")).c_str(),
          moefit::experts::BM_ExpertLayer, std::string("grouped"), dtype,
          moefit::experts::BackendOptions{}, other)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime()
          ->MinTime(1.0);
    }
  }
  // The grouped backend without its packed weights and fused SwiGLU (each
  // GEMM packs its weight, one scalar SiLU pass): what those two give, in
  // the same run.
  for (auto [dtype, dname] : {std::pair{at::kFloat, "fp32"}, std::pair{at::kBFloat16, "bf16"}}) {
    benchmark::RegisterBenchmark(
        (std::string("experts/grouped_unpacked_unfused/") + dname).c_str(),
        moefit::experts::BM_ExpertLayer, std::string("grouped"), dtype,
        moefit::experts::BackendOptions{.packed_weight_bytes = 0, .fused_swiglu = false},
        std::nullopt)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->MinTime(1.0);
  }
  for (const bool ours : {true, false}) {
    benchmark::RegisterBenchmark(ours ? "copies/ours" : "copies/index_add",
                                 moefit::experts::BM_SumCopies, ours)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->MinTime(0.5);
  }
  benchmark::RegisterBenchmark("gemm/fp32", moefit::experts::BM_Gemm, at::kFloat)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime()
      ->MinTime(1.0);
  for (auto [dtype, dname] : {std::pair{at::kFloat, "fp32"}, std::pair{at::kBFloat16, "bf16"}}) {
    benchmark::RegisterBenchmark((std::string("lora/") + dname).c_str(),
                                 moefit::experts::BM_LoraStep, dtype)
        ->Unit(benchmark::kMillisecond)
        ->UseManualTime()
        ->Iterations(3);
  }
  benchmark::Initialize(&rest_argc, rest.data());
  moefit::experts::TableReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintTable();
  benchmark::Shutdown();
  return 0;
}
