// What routing telemetry, TensorBoard and the expert map add to a training
// step, piece by piece, against the step itself, in one process: the
// end-to-end benchmark's shape (benchmarks/e2e/train_vs_transformers.py's
// defaults: qwen3_moe, hidden 512, 32 experts of intermediate 256, top-4, 4
// layers, 8 sequences of 256 tokens) or --hidden= --experts= --inter=
// --top_k= --layers= --batch= --seq=.
//
// The step: the median wall clock of --steps=6 Trainer steps (after two
// untimed) with routing telemetry off. The additions, each the median of
// --reps=50 runs on inputs of the step's shapes: the routers' entropy (one
// [tokens, experts] pass per MoE layer), the wider per-layer sums packed for
// the all-reduce, the step's figures and decayed counters, the metrics line's
// extra fields, the TensorBoard event (built and written), and the expert map
// (drawn, encoded and written; counted as if drawn every step). A whole-run
// A/B (benchmarks/e2e/telemetry_overhead.py) measures the same thing end to
// end where the machine is quiet enough to resolve it.
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "framework/data.h"
#include "framework/expert_map.h"
#include "framework/model.h"
#include "framework/output_dir.h"
#include "framework/routing_telemetry.h"
#include "framework/step_summaries.h"
#include "framework/tensorboard_writer.h"
#include "framework/trainer.h"
#include "launch/config.h"
#include "launch/corpus.h"
#include "proto/metrics.pb.h"
#include "router/routing_stats.h"

namespace {

using Clock = std::chrono::steady_clock;

double MedianMs(int64_t reps, const std::function<void()>& f) {
  std::vector<double> ms;
  f();  // untimed
  for (int64_t i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moefit;
  int64_t hidden = 512, experts = 32, inter = 256, top_k = 4, layers = 4, batch = 8, seq = 256,
          steps = 6, reps = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    bool known = false;
    for (auto [flag, v] : std::vector<std::pair<std::string, int64_t*>>{{"--hidden=", &hidden},
                                                                        {"--experts=", &experts},
                                                                        {"--inter=", &inter},
                                                                        {"--top_k=", &top_k},
                                                                        {"--layers=", &layers},
                                                                        {"--batch=", &batch},
                                                                        {"--seq=", &seq},
                                                                        {"--steps=", &steps},
                                                                        {"--reps=", &reps}}) {
      if (a.rfind(flag, 0) == 0) {
        *v = std::atoll(a.c_str() + flag.size());
        known = true;
      }
    }
    if (!known) {
      std::fprintf(stderr,
                   "usage: telemetry_bench [--hidden= --experts= --inter= --top_k= --layers= "
                   "--batch= --seq= --steps= --reps=]\n");
      return 2;
    }
  }
  auto s = [](const std::string& k, int64_t v) { return k + "=" + std::to_string(v); };
  auto config = launch::LoadConfig(
      "", {s("model.hidden_size", hidden), s("model.moe_intermediate_size", inter),
           s("model.intermediate_size", 2 * hidden), s("model.num_experts", experts),
           s("model.num_experts_per_tok", top_k), s("model.num_hidden_layers", layers),
           "model.num_attention_heads=8", "model.num_key_value_heads=4", "model.head_dim=64",
           s("train.seq_len", seq), s("train.micro_batch_size", batch), s("train.steps", steps + 2),
           "parallel.device=cpu", "logging.metrics_file=", "logging.routing_telemetry=false"});
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 2;
  }
  auto run = launch::ResolveConfig(*config);
  if (!run.ok()) {
    std::fprintf(stderr, "%s\n", run.status().ToString().c_str());
    return 2;
  }
  auto data = framework::TokenDataset::FromText(launch::ShippedCorpus(), seq, "corpus");
  auto model = framework::MoeModel::Create(run->model, run->runtime, 1);
  framework::Trainer trainer(**model, *data, run->train);
  std::vector<double> step_ms;
  framework::StepStats last;
  for (int64_t i = 0; i < steps + 2; ++i) {
    last = trainer.Step(i);
    if (i >= 2) step_ms.push_back(last.seconds * 1e3);
  }
  std::sort(step_ms.begin(), step_ms.end());
  const double step = step_ms[step_ms.size() / 2];

  // Inputs of the step's shapes.
  const int64_t tokens = batch * seq;
  at::Tensor probs = at::softmax(at::randn({tokens, experts}), -1);
  std::vector<framework::MoeLayerRouting> routing(static_cast<size_t>(layers));
  for (int64_t l = 0; l < layers; ++l) {
    routing[l].layer_idx = l;
    routing[l].expert_count = at::rand({experts}) * 100;
    routing[l].prob_sum = at::rand({experts}) * 100;
    routing[l].entropy_sum = at::full({}, 1.0, at::kDouble);
  }
  framework::ModelOptions mo = run->model;
  const framework::RoutingColumns off{.num_experts = experts, .telemetry = false};
  const framework::RoutingColumns on{.num_experts = experts, .telemetry = true};
  framework::RoutingTelemetry telemetry({.enabled = true, .half_life_steps = 50});
  framework::StepStats stats = last;  // the step's own figures, telemetry filled below
  const double entropy = MedianMs(reps, [&] {
    for (int64_t l = 0; l < layers; ++l) router::RouterEntropySum(probs).cpu();
  });
  const double pack = MedianMs(reps, [&] { framework::PackRoutingSums(routing, on); }) -
                      MedianMs(reps, [&] { framework::PackRoutingSums(routing, off); });
  at::Tensor sums = framework::PackRoutingSums(routing, on);
  const double figures = MedianMs(reps, [&] {
    telemetry.BeginStep();
    telemetry.AddMicroBatch(sums, routing, mo, batch);
    stats.moe_layers.clear();
    telemetry.EndStep(&stats);
  });
  // The metrics line as the trainer writes it, with the telemetry's figures
  // and without them (what a run with routing telemetry off has).
  framework::TrainOptions with = run->train, without = run->train;
  with.routing_telemetry = true;
  framework::StepStats plain_stats = stats;
  for (framework::LayerLoad& ll : plain_stats.moe_layers) {
    ll.cv = 0;
    ll.decayed_load.clear();
    ll.router_entropy = 0;
    ll.balance_loss.reset();
  }
  const proto::StepMetrics full = framework::StepMetricsOf(stats, with, 0, 0);
  const proto::StepMetrics plain = framework::StepMetricsOf(plain_stats, without, 0, 0);
  const double metrics = MedianMs(reps, [&] { (void)framework::MetricsLine(full); }) -
                         MedianMs(reps, [&] { (void)framework::MetricsLine(plain); });
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("telemetry_bench_" + std::to_string(::getpid()));
  auto tb = framework::TensorBoardWriter::Open(dir / "tb", 1);
  int64_t tb_step = 0;
  const double tensorboard =
      MedianMs(reps, [&] { (void)(*tb)->Write(++tb_step, framework::StepSummary(stats, 1000.0)); });
  const double map = MedianMs(reps, [&] {
    auto image = framework::DrawExpertMap(framework::StepExpertMap(stats));
    auto png = framework::EncodePng(*image);
    (void)framework::WriteTextFile(dir / "expert-map.png", *png);
  });
  std::filesystem::remove_all(dir);
  const double total = entropy + pack + figures + metrics + tensorboard + map;
  std::printf("step (telemetry off): %.1f ms median of %lld\n", step,
              static_cast<long long>(step_ms.size()));
  std::printf(
      "telemetry: entropy %.3f + sums %.3f + figures %.3f + metrics line %.3f ms; TensorBoard "
      "%.3f ms; expert map %.3f ms\n",
      entropy, pack, figures, metrics, tensorboard, map);
  std::printf(
      "total %.3f ms = %.2f%% of the step (telemetry + TensorBoard %.2f%%; the map, drawn every "
      "step, %.2f%%)\n",
      total, 100 * total / step, 100 * (total - map) / step, 100 * map / step);
  return 0;
}
