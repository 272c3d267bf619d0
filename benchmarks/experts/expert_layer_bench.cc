// Forward + backward of one routed-expert layer for each backend and dtype,
// beside one large GEMM with the same FLOPs run in the same process (the
// machine's practical ceiling). Timing claims are ratios to that ceiling,
// measured in the same run, because the machines are shared and noisy.
//
// Shape (defaults near a Qwen3-30B-A3B layer): --tokens=4096 --hidden=2048
// --inter=768 --experts=32 --top_k=8, routing uniform or --pattern=skewed
// (Zipf-like: a few hot experts); the problems are the ones the backend tests
// check (experts/expert_problem.h).
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "experts/expert_function.h"
#include "experts/expert_problem.h"
#include "experts/registry.h"

namespace moefit::experts {
namespace {

ExpertProblemShape g_shape{"layer", 4096, 2048, 768, 32, 8, RoutingPattern::kUniform};
// Reports `flops` per iteration as a GFLOP/s rate.
void Record(benchmark::State& state, double flops) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_ExpertLayer(benchmark::State& state, std::string backend_name, at::ScalarType dtype) {
  ExpertProblem p = MakeExpertProblem(g_shape, dtype, 0);
  auto backend = CreateExpertBackend(backend_name, {});
  if (!backend.ok()) {
    state.SkipWithError(std::string(backend.status().message()).c_str());
    return;
  }
  for (auto _ : state) {
    at::Tensor act;
    at::Tensor y = (*backend)->Forward(p.x, p.counts, {p.gate_up_proj, p.down_proj}, &act);
    ExpertGrads g = (*backend)->Backward(p.grad_y, p.x, p.counts, {p.gate_up_proj, p.down_proj}, act);
    benchmark::DoNotOptimize(g.x.data_ptr());
  }
  Record(state, 3.0 * ExpertForwardFlops(g_shape));
}

// One [M, K] x [K, N] GEMM with the FLOPs of forward + backward of the layer.
void BM_Gemm(benchmark::State& state, at::ScalarType dtype) {
  const double flops = 3.0 * ExpertForwardFlops(g_shape);
  const int64_t n = 2048, k = 2048;
  const int64_t m = static_cast<int64_t>(std::llround(flops / (2.0 * n * k)));
  at::Tensor a = at::randn({m, k}).to(dtype), b = at::randn({k, n}).to(dtype);
  at::Tensor c = at::empty({m, n}, a.options());
  for (auto _ : state) {
    at::mm_out(c, a, b);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  Record(state, 2.0 * m * n * k);
}

class TableReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      auto it = r.counters.find("GFLOP/s");
      std::string name = r.benchmark_name();
      name = name.substr(0, name.find("/min_time"));
      if (it != r.counters.end()) rates_[name] = it->second.value;
    }
  }
  void PrintTable() const {
    std::printf("\nexpert layer fwd+bwd, tokens=%ld hidden=%ld inter=%ld experts=%ld top_k=%ld %s\n",
                (long)g_shape.num_tokens, (long)g_shape.hidden, (long)g_shape.intermediate,
                (long)g_shape.num_experts, (long)g_shape.top_k,
                g_shape.pattern == moefit::experts::RoutingPattern::kSkewed ? "skewed" : "uniform");
    std::printf("%-24s %10s %20s\n", "benchmark", "GFLOP/s", "vs GEMM same dtype");
    for (const auto& [name, rate] : rates_) {
      const bool bf16 = name.find("bf16") != std::string::npos;
      auto ceiling = rates_.find(bf16 ? "gemm/bf16" : "gemm/fp32");
      std::printf("%-24s %10.1f %20.2f\n", name.c_str(), rate,
                  ceiling != rates_.end() && ceiling->second > 0 ? rate / ceiling->second : 0.0);
    }
  }

 private:
  std::map<std::string, double> rates_;
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
    if (std::strcmp(argv[i], "--pattern=skewed") == 0) {
      g_shape.pattern = moefit::experts::RoutingPattern::kSkewed;
      continue;
    }
    if (take("--tokens", &g_shape.num_tokens) || take("--hidden", &g_shape.hidden) ||
        take("--inter", &g_shape.intermediate) || take("--experts", &g_shape.num_experts) ||
        take("--top_k", &g_shape.top_k)) {
      continue;
    }
    rest.push_back(argv[i]);
  }
  int rest_argc = static_cast<int>(rest.size());
  for (const char* backend : {"eager", "grouped"}) {
    for (auto [dtype, dname] : {std::pair{at::kFloat, "fp32"}, std::pair{at::kBFloat16, "bf16"}}) {
      benchmark::RegisterBenchmark((std::string("experts/") + backend + "/" + dname).c_str(),
                                   moefit::experts::BM_ExpertLayer, std::string(backend), dtype)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime()
          ->MinTime(2.0);
    }
  }
  for (auto [dtype, dname] : {std::pair{at::kFloat, "fp32"}, std::pair{at::kBFloat16, "bf16"}}) {
    benchmark::RegisterBenchmark((std::string("gemm/") + dname).c_str(), moefit::experts::BM_Gemm,
                                 dtype)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->MinTime(2.0);
  }
  benchmark::Initialize(&rest_argc, rest.data());
  moefit::experts::TableReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintTable();
  benchmark::Shutdown();
  return 0;
}
