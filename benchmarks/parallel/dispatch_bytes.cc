// The bytes per training step that cross between ranks in the token exchange,
// with deduplicated dispatch (what moefit sends) and one row per (token, slot)
// (what it sent before), forward and backward, at the world size it runs at:
//   real routing:    one forward and backward of the trained model of a
//                    training checkpoint (its shape and data from the
//                    checkpoint's config) on a global batch of its data, each
//                    rank with its own sequences: the routers decide;
//   uniform routing: the same tokens, hidden size and MoE layers, every token's
//                    k experts drawn uniformly (through the same dispatcher).
// Counted, not timed (step_traffic.h): the same numbers on any machine.
//
//   mpirun -np 4 build/benchmarks/dispatch_bytes --checkpoint=DIR [--sequences=N]
// DIR is a training checkpoint (save_dir/step-NNNNNNNN) of any world size;
// --sequences per rank (default the config's train.micro_batch_size).
// benchmarks/parallel/dispatch_bytes.sh trains the demo model at top-8 of 64
// experts and runs this at 4 and 8 ranks.
#include <ATen/ATen.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "benchmarks/parallel/step_traffic.h"
#include "checkpoint/training_manifest.h"
#include "framework/data.h"
#include "framework/model.h"
#include "framework/training_checkpoint.h"
#include "launch/config.h"
#include "launch/run_setup.h"
#include "parallel/counting_communicator.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_runtime.h"

namespace {

using namespace moefit;

template <typename T>
T OrAbort(absl::StatusOr<T> v) {
  if (!v.ok()) parallel::AbortAll(2, v.status().ToString());
  return *std::move(v);
}

// `t`'s one layer as `layers` layers alike.
bench::StepTraffic Times(bench::StepTraffic t, int64_t layers) {
  for (bench::ExchangeBytes* b : {&t.before, &t.after}) {
    b->rows *= layers;
    b->forward *= layers;
    b->backward *= layers;
  }
  t.layers = layers;
  return t;
}

void Run(const std::string& dir, int64_t sequences) {
  auto world = OrAbort(parallel::MpiCommunicator::Create(MPI_COMM_WORLD));
  const proto::TrainingCheckpointManifest manifest = OrAbort(checkpoint::ReadManifest(dir));
  std::vector<std::string> overrides = {"parallel.device=cpu"};
  if (sequences > 0) overrides.push_back("train.micro_batch_size=" + std::to_string(sequences));
  const proto::Config config =
      OrAbort(launch::LoadConfigText(manifest.config_text(), dir + "/manifest", overrides));
  launch::RunConfig run = OrAbort(launch::ResolveConfig(config));
  auto counting = parallel::CountingCommunicator::Create(world);
  run.runtime.expert_group = counting;
  run.runtime.dense_device = c10::kCPU;
  auto model = OrAbort(framework::MoeModel::Create(run.model, run.runtime, run.train.seed,
                                                   framework::WeightInit::kUninitialized));
  const int64_t step = OrAbort(framework::LoadCheckpointWeights(*model, world->rank(), dir));
  const framework::TokenDataset data = OrAbort(launch::LoadDataset(run));

  // The global batch training would take next, this rank's share of it.
  const int64_t per_rank = run.train.micro_batch_size;
  framework::BatchSampler sampler(data.num_sequences(), run.train.seed);
  const std::vector<int64_t> global = sampler.GlobalBatch(step, per_rank * world->size());
  const std::vector<int64_t> mine(global.begin() + per_rank * world->rank(),
                                  global.begin() + per_rank * (world->rank() + 1));
  const bench::StepTraffic real =
      bench::CountModelStep(*model, *counting, *world, data.Gather(mine));

  const framework::ModelOptions& o = model->options();
  const at::ScalarType dtype = run.runtime.expert_compute_dtype();
  const bench::StepTraffic uniform =
      Times(bench::CountUniformLayer(world, per_rank * run.seq_len, o.hidden_size,
                                     o.num_experts_per_tok, o.num_experts, dtype, run.train.seed),
            real.layers);

  if (world->rank() == 0) {
    std::printf(
        "top-%ld of %ld experts over %d ranks (%ld each), %ld x %ld tokens per rank, hidden %ld "
        "in %s; the model of %s (after step %ld)\n"
        "bytes that cross between ranks per training step, summed over ranks and MoE layers:\n",
        static_cast<long>(o.num_experts_per_tok), static_cast<long>(o.num_experts), world->size(),
        static_cast<long>(model->placement().max_local()), static_cast<long>(per_rank),
        static_cast<long>(run.seq_len), static_cast<long>(o.hidden_size),
        dtype == at::kFloat      ? "float32"
        : dtype == at::kBFloat16 ? "bfloat16"
                                 : c10::toString(dtype),
        dir.c_str(), static_cast<long>(step));
  }
  bench::PrintTraffic(world->rank(), "uniform routing", uniform);
  bench::PrintTraffic(world->rank(), "real routing, the trained model", real);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moefit;
  auto runtime = parallel::MpiRuntime::Start(&argc, &argv, {});
  if (!runtime.ok()) return 1;
  std::string dir;
  int64_t sequences = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--checkpoint=", 13) == 0) {
      dir = argv[i] + 13;
    } else if (std::strncmp(argv[i], "--sequences=", 12) == 0) {
      sequences = std::atoll(argv[i] + 12);
    } else {
      parallel::AbortAll(2, std::string("unknown argument '") + argv[i] +
                                "' (usage: dispatch_bytes --checkpoint=DIR [--sequences=N])");
    }
  }
  if (dir.empty()) parallel::AbortAll(2, "usage: dispatch_bytes --checkpoint=DIR [--sequences=N]");
  try {
    Run(dir, sequences);
  } catch (const std::exception& e) {
    parallel::AbortAll(1, e.what());
  }
  return 0;
}
