// The start-up memory bound: a model started from a checkpoint holds its
// weights once.
//
// Starting from `model.model_path` used to cost about twice the weights: every
// rank drew random values for every expert, then the loader built a second copy
// of everything that was copied over. The parameters are now allocated
// uninitialized and the loader writes into them, so each rank's peak resident
// memory after start-up must stay within
//
//     VmHWM <= 1.10 x (this rank's parameter bytes in host RAM) + 1 GiB
//
// (the 10% for the loader's bounded in-flight conversions and the allocator,
// the GiB for LibTorch, MPI and the process itself). Two modes, each run in a
// fresh process so that writing the checkpoint does not count towards loading
// it (startup_memory.cmake runs them and removes the checkpoint after):
//
//   startup_memory_check generate DIR
//       writes a qwen3_moe checkpoint of about 1.6 GB in bf16 (8 layers of 32
//       experts of 1024 x 1024, expert e of every layer holding e + 1 in
//       gate/up and -(e + 1) in down) with its config.json;
//   mpirun -np N startup_memory_check check DIR
//       every rank starts a run from DIR as `moefit train` does
//       (launch::BuildModel of launch/run_setup.h, experts in bf16, dense
//       part on the CPU, printing the memory report), checks its own bound
//       and that its experts hold their values; every rank exits non-zero if
//       any rank failed.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/weight_exporter.h"
#include "framework/hf_io.h"
#include "framework/model.h"
#include "launch/config.h"
#include "launch/memory_report.h"
#include "launch/run_setup.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_runtime.h"

namespace moefit {
namespace {

namespace fs = std::filesystem;

constexpr double kGiB = static_cast<double>(int64_t{1} << 30);
constexpr double kFactor = 1.10;
constexpr int64_t kSlackBytes = int64_t{1} << 30;

// The run both modes resolve: the demo run on the big model (generate) or on
// DIR's config.json (check), experts in bf16, everything on the CPU.
absl::StatusOr<launch::RunConfig> Run(std::vector<std::string> overrides) {
  overrides.push_back("experts.dtype=bfloat16");
  overrides.push_back("parallel.device=cpu");
  absl::StatusOr<proto::Config> config = launch::LoadConfig("", overrides);
  if (!config.ok()) return config.status();
  return launch::ResolveConfig(*config);
}

// The value every element of expert `e` holds in a tensor of the checkpoint.
double ExpertValue(const std::string& name, int64_t e) {
  const double v = static_cast<double>(e + 1);  // integers up to 256 are exact in bf16
  return name.ends_with("down_proj") ? -v : v;
}

int Generate(const fs::path& dir) {
  absl::StatusOr<launch::RunConfig> run =
      Run({"model.vocab_size=512", "model.hidden_size=1024", "model.num_attention_heads=8",
           "model.num_key_value_heads=2", "model.head_dim=64", "model.moe_intermediate_size=1024",
           "model.intermediate_size=1024", "model.num_hidden_layers=8", "model.num_experts=32",
           "model.num_experts_per_tok=2"});
  if (!run.ok()) {
    std::cerr << "generate: " << run.status() << std::endl;
    return 1;
  }
  // Every tensor is written next: no random draw needed.
  auto model = framework::MoeModel::Create(run->model, run->runtime, /*seed=*/0,
                                           framework::WeightInit::kUninitialized);
  if (!model.ok()) {
    std::cerr << "generate: " << model.status() << std::endl;
    return 1;
  }
  torch::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> tensors;
  for (const framework::Parameter& p : (*model)->named_tensors()) {
    if (p.expert) {
      for (int64_t e = 0; e < p.tensor.size(0); ++e) p.tensor[e].fill_(ExpertValue(p.name, e));
    } else {
      p.tensor.fill_(0.01);
    }
    tensors[p.name] = p.tensor.detach();
  }
  fs::remove_all(dir);
  // Throwaway output: not synced to disk.
  absl::Status saved = checkpoint::SaveCheckpoint(
      dir, run->model.model_type, tensors,
      {.max_shard_bytes = 256 << 20, .dtype = at::kBFloat16, .sync = false});
  if (saved.ok()) {
    std::ofstream(dir / "config.json") << framework::HfConfigJson(run->model, at::kBFloat16);
  }
  if (!saved.ok()) {
    std::cerr << "generate: " << saved << std::endl;
    return 1;
  }
  uint64_t bytes = 0;
  for (const auto& entry : fs::directory_iterator(dir)) bytes += entry.file_size();
  std::cout << absl::StrFormat("generate: %s, %.2f GB", dir.string(), bytes / 1e9) << std::endl;
  return 0;
}

// This rank's problems, empty when it is within the bound and holds the right values.
std::string Check(const fs::path& dir, const std::shared_ptr<parallel::Communicator>& world) {
  absl::StatusOr<launch::RunConfig> run = Run({"model.model_path=" + dir.string()});
  if (!run.ok()) return run.status().ToString();
  std::ostringstream discard;
  absl::StatusOr<launch::ParallelModel> built =
      launch::BuildModel(*run, world, world->rank() == 0 ? std::cout : discard);
  if (!built.ok()) return built.status().ToString();
  const framework::MoeModel& model = *built->model;
  absl::StatusOr<int64_t> peak = launch::PeakRssBytes();
  if (!peak.ok()) return peak.status().ToString();

  int64_t host_bytes = 0;
  for (const framework::Parameter& p : model.named_tensors()) {
    if (p.tensor.device().is_cpu()) host_bytes += static_cast<int64_t>(p.tensor.nbytes());
  }
  const double bound = kFactor * static_cast<double>(host_bytes) + kSlackBytes;
  std::string problems;
  std::cout << absl::StrFormat(
                   "rank %d: peak RSS %.3f GiB, bound %.2f x %.3f GiB of parameters + 1 GiB = "
                   "%.3f GiB",
                   world->rank(), *peak / kGiB, kFactor, host_bytes / kGiB, bound / kGiB)
            << std::endl;
  if (static_cast<double>(*peak) > bound) {
    absl::StrAppend(&problems, absl::StrFormat("peak RSS %.3f GiB exceeds the bound %.3f GiB; ",
                                               *peak / kGiB, bound / kGiB));
  }
  // The loader wrote this rank's experts into the model's own tensors.
  const int64_t first = model.placement().first_expert(model.runtime().expert_group->rank());
  for (const framework::Parameter& p : model.parameters()) {
    if (!p.expert) continue;
    for (int64_t k = 0; k < p.tensor.size(0); ++k) {
      const at::Tensor flat = p.tensor[k].flatten();
      const double want = ExpertValue(p.name, first + k);
      for (const int64_t idx : {int64_t{0}, flat.numel() / 2, flat.numel() - 1}) {
        const double got = flat[idx].item<double>();
        if (got != want) {
          absl::StrAppend(&problems, p.name, "[", k, "] holds ", got, ", expected ", want, "; ");
          break;
        }
      }
    }
  }
  return problems;
}

}  // namespace
}  // namespace moefit

int main(int argc, char** argv) {
  using namespace moefit;  // NOLINT(build/namespaces): a test driver's main
  if (argc == 3 && std::string(argv[1]) == "generate") return Generate(argv[2]);
  if (argc != 3 || std::string(argv[1]) != "check") {
    std::cerr << "usage: startup_memory_check generate|check DIR" << std::endl;
    return 2;
  }
  absl::StatusOr<std::unique_ptr<parallel::MpiRuntime>> runtime =
      parallel::MpiRuntime::Start(&argc, &argv);
  if (!runtime.ok()) {
    std::cerr << "cannot start MPI: " << runtime.status() << std::endl;
    return 1;
  }
  absl::StatusOr<std::shared_ptr<parallel::MpiCommunicator>> world =
      parallel::MpiCommunicator::Create(MPI_COMM_WORLD);
  if (!world.ok()) parallel::AbortAll(1, world.status().ToString());
  const std::string problems = Check(argv[2], *world);
  if (!problems.empty()) std::cerr << "rank " << (*world)->rank() << ": " << problems << std::endl;
  // Every rank agrees, so mpirun's exit code does not depend on which one failed.
  at::Tensor failed = at::full({1}, problems.empty() ? 0 : 1, at::kLong);
  (*world)->AllReduce(failed, parallel::ReduceOp::kMax)->WaitOrThrow();
  const bool job_failed = failed.item<int64_t>() != 0;
  world->reset();
  runtime->reset();  // MPI_Finalize
  return job_failed ? 1 : 0;
}
