// Expert-parallel communication under mpirun (2 processes by default):
//
//  1. Dispatch + combine of the (deduplicated) alltoall dispatcher against a
//     bare MPI_Alltoallv moving the same rows there and back in the same run
//     (throughput ratio), and against a bare MPI_Alltoallv of the rows a
//     dispatcher without deduplication would move (one per (token, slot)).
//     The dispatcher's extra work is the counts exchange, the gather of rows
//     before sending, the routing weights and indices, the index of the rows
//     the experts read, the weighted sum per token of its experts' outputs
//     before sending back and the sum over ranks at home. The experts' output
//     ([rows x experts visited, hidden], what combine reads) is made once,
//     before the timing: the expert layer writes it. Dispatch and combine are
//     also timed alone, and the same tokens go through a one-process
//     dispatcher (every expert local, nothing exchanged): it makes the same
//     routing-weighted sum of each token's top-k outputs, which every MoE
//     layer makes with or without expert parallelism and which, reading every
//     expert output row once, is most of combine's time; it is timed again
//     with its backward (identity experts). The last ratio sets the bare
//     exchange against what expert parallelism adds to that.
//  2. One training step of a small MoE model split into dense compute, expert
//     compute and communication (time blocked in collectives), averaged over
//     steps after a warm-up; with each MoE layer in 1 chunk (no pipelining),
//     then pipelined over 2, 4, ... up to --max_chunks token chunks
//     (parallel.dispatch_chunks), with the share of the one-chunk run's
//     communication time that pipelining hid.
//  3. Bytes, counted rather than timed (step_traffic.h): what crosses between
//     ranks in one layer's dispatch and combine, forward and backward, under
//     the uniform routing of part 1, and in one training step of the demo
//     model of part 2, with deduplication (what moefit sends) and one row per
//     (token, slot) (what it sent before), summed over ranks.
//
//   mpirun -np 2 --oversubscribe build/benchmarks/dispatch_bench [--tokens=4096]
//        [--hidden=2048] [--top_k=8] [--experts=32] [--reps=10] [--steps=6]
//        [--max_chunks=4] [--progress_us=0]
// --steps=1 (or 0) skips the training step: its mean is over the steps after
// the first. --progress_us=N runs MPI's progress engine on a thread of its own every N
// microseconds while collectives are in flight (parallel.progress_thread_us).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <sstream>
#include <vector>

#include "benchmarks/parallel/step_traffic.h"
#include "framework/data.h"
#include "framework/host_allocator.h"
#include "framework/model.h"
#include "framework/trainer.h"
#include "launch/config.h"
#include "launch/corpus.h"
#include "parallel/counting_communicator.h"
#include "parallel/dispatcher.h"
#include "parallel/local_communicator.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_progress.h"
#include "parallel/mpi_runtime.h"
#include "parallel/process_groups.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  int64_t tokens = 4096, hidden = 2048, top_k = 8, experts = 32, reps = 10, steps = 6;
  int64_t max_chunks = 4, progress_us = 0;
};

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    auto take = [&](const char* name, int64_t* out) {
      const size_t n = std::strlen(name);
      if (std::strncmp(argv[i], name, n) == 0 && argv[i][n] == '=')
        *out = std::atoll(argv[i] + n + 1);
    };
    take("--tokens", &f.tokens);
    take("--hidden", &f.hidden);
    take("--top_k", &f.top_k);
    take("--experts", &f.experts);
    take("--reps", &f.reps);
    take("--steps", &f.steps);
    take("--max_chunks", &f.max_chunks);
    take("--progress_us", &f.progress_us);
  }
  return f;
}

double MaxOverRanks(double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return v;
}

// A bare MPI_Alltoallv there and back of `rows_to[q]` rows of `hidden`
// floats to each rank q, timed per round trip (max over ranks).
struct BareExchange {
  std::vector<int> send, recv, sdispl, rdispl;
  std::vector<float> sbuf, rbuf;
  int64_t send_rows = 0;

  BareExchange(const std::vector<int64_t>& rows_to, int64_t hidden) {
    const int world = static_cast<int>(rows_to.size());
    send.resize(world);
    recv.resize(world);
    sdispl.assign(world, 0);
    rdispl.assign(world, 0);
    for (int q = 0; q < world; ++q) send[q] = static_cast<int>(rows_to[q] * hidden);
    MPI_Alltoall(send.data(), 1, MPI_INT, recv.data(), 1, MPI_INT, MPI_COMM_WORLD);
    std::partial_sum(send.begin(), send.end() - 1, sdispl.begin() + 1);
    std::partial_sum(recv.begin(), recv.end() - 1, rdispl.begin() + 1);
    sbuf.assign(std::accumulate(send.begin(), send.end(), int64_t{0}), 1.0f);
    rbuf.assign(std::accumulate(recv.begin(), recv.end(), int64_t{0}), 0.0f);
    send_rows = std::accumulate(rows_to.begin(), rows_to.end(), int64_t{0});
  }
  void RoundTrip() {
    MPI_Alltoallv(sbuf.data(), send.data(), sdispl.data(), MPI_FLOAT, rbuf.data(), recv.data(),
                  rdispl.data(), MPI_FLOAT, MPI_COMM_WORLD);
    MPI_Alltoallv(rbuf.data(), recv.data(), rdispl.data(), MPI_FLOAT, sbuf.data(), send.data(),
                  sdispl.data(), MPI_FLOAT, MPI_COMM_WORLD);
  }
};

void DispatchVersusAlltoallv(moefit::parallel::ProcessGroups& groups, const Flags& f) {
  using namespace moefit;
  auto& ep = groups.expert_parallel;
  const int world = ep->size(), rank = ep->rank();
  auto placement = router::ExpertPlacement::Contiguous(f.experts, world);
  auto dispatcher = parallel::CreateDispatcher("alltoall", ep, *placement);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7 + rank);
  at::Tensor x = at::randn({f.tokens, f.hidden}, gen, at::kFloat);
  // Top-k distinct experts per token, as a router picks them.
  at::Tensor idx = std::get<1>(at::rand({f.tokens, f.experts}, gen).topk(f.top_k, 1));
  at::Tensor weight = at::softmax(at::randn({f.tokens, f.top_k}, gen), 1);

  // Rows per owner rank: one per (token, slot) without deduplication, one per
  // (token, owner) with it.
  std::vector<int64_t> per_slot(world, 0), per_pair(world, 0);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < f.tokens; ++t) {
    std::vector<bool> seen(world, false);
    for (int64_t j = 0; j < f.top_k; ++j) {
      const int q = placement->owner(ip[t * f.top_k + j]);
      ++per_slot[q];
      if (!seen[q]) ++per_pair[q];
      seen[q] = true;
    }
  }
  BareExchange undeduplicated(per_slot, f.hidden), same_bytes(per_pair, f.hidden);

  torch::NoGradGuard no_grad;
  auto time_it = [&](auto&& fn) {
    fn();  // warm-up
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = Clock::now();
    for (int64_t r = 0; r < f.reps; ++r) fn();
    return MaxOverRanks(std::chrono::duration<double>(Clock::now() - t0).count() / f.reps);
  };
  const double bare_slots = time_it([&] { undeduplicated.RoundTrip(); });
  const double bare_pairs = time_it([&] { same_bytes.RoundTrip(); });
  int64_t sent_rows = 0;
  // Identity experts: each computation row's input, made once in the caching
  // host allocator (as moefit's expert layers make their outputs) for all the
  // runs below.
  framework::UseCachingHostAllocator(true);
  at::Tensor expert_out;
  {
    parallel::DispatchedRows d = (*dispatcher)->Dispatch(x, idx, weight);
    expert_out = d.rows.index_select(0, d.row_index);
  }
  auto dispatch_combine = [&] {
    parallel::DispatchedRows d = (*dispatcher)->Dispatch(x, idx, weight);
    sent_rows = d.sent_rows;
    at::Tensor back = (*dispatcher)->Combine(expert_out, *d.route);
  };
  // With LibTorch's default host allocator, then with moefit's caching one
  // (what `moefit` uses).
  framework::UseCachingHostAllocator(false);
  const double ours_system = time_it(dispatch_combine);
  framework::UseCachingHostAllocator(true);
  const double ours = time_it(dispatch_combine);
  parallel::DispatchedRows held;
  const double dispatch_only = time_it([&] { held = (*dispatcher)->Dispatch(x, idx, weight); });
  const double combine_only = time_it([&] { (*dispatcher)->Combine(expert_out, *held.route); });
  // The same tokens through one process's dispatcher (every expert local):
  // the same number of expert rows, and the same routing-weighted sum of each
  // token's top-k outputs, which every MoE layer makes with or without
  // expert parallelism; nothing crosses to another process.
  auto one_placement = router::ExpertPlacement::Contiguous(f.experts, 1);
  auto one_process =
      parallel::CreateDispatcher("alltoall", parallel::LocalCommunicator::Create(), *one_placement);
  at::Tensor one_out;
  const double local = time_it([&] {
    parallel::DispatchedRows d = (*one_process)->Dispatch(x, idx, weight);
    if (!one_out.defined()) one_out = d.rows.index_select(0, d.row_index);
    at::Tensor back = (*one_process)->Combine(one_out, *d.route);
  });
  // And with gradients: the sum's backward hands each expert row its token's
  // gradient times the routing weight, and each routing weight the dot product
  // of its expert row with that gradient.
  const at::Tensor x_leaf = x.detach().requires_grad_(true);
  const at::Tensor weight_leaf = weight.detach().requires_grad_(true);
  const at::Tensor grad_out = at::randn({f.tokens, f.hidden}, gen, at::kFloat);
  const double local_backward = time_it([&] {
    c10::AutoGradMode grad_mode(true);
    parallel::DispatchedRows d = (*one_process)->Dispatch(x_leaf, idx, weight_leaf);
    at::Tensor back = (*one_process)->Combine(d.rows.index_select(0, d.row_index), *d.route);
    back.backward(grad_out);
  });
  if (sent_rows != same_bytes.send_rows) {
    parallel::AbortAll(1, "the dispatcher sent " + std::to_string(sent_rows) + " rows, expected " +
                              std::to_string(same_bytes.send_rows));
  }
  auto gb = [&](int64_t rows) {
    return 2.0 * static_cast<double>(rows * f.hidden) * sizeof(float) / 1e9;
  };
  if (rank == 0) {
    std::printf(
        "dispatch+combine vs bare MPI_Alltoallv, %d ranks, %ld tokens/rank x top-%ld of %ld "
        "experts, "
        "hidden %ld fp32, rank 0's bytes per round trip:\n",
        world, (long)f.tokens, (long)f.top_k, (long)f.experts, (long)f.hidden);
    std::printf("  %-44s %9.2f ms %8.3f GB\n", "bare MPI_Alltoallv, one row per (token, slot)",
                bare_slots * 1e3, gb(undeduplicated.send_rows));
    std::printf("  %-44s %9.2f ms %8.3f GB\n", "bare MPI_Alltoallv, one row per (token, rank)",
                bare_pairs * 1e3, gb(same_bytes.send_rows));
    std::printf("  %-44s %9.2f ms %8.3f GB\n", "alltoall dispatch+combine, default allocator",
                ours_system * 1e3, gb(sent_rows));
    std::printf("  %-44s %9.2f ms %8.3f GB\n", "alltoall dispatch+combine (moefit)", ours * 1e3,
                gb(sent_rows));
    std::printf("  %-44s %9.2f ms\n", "  dispatch alone", dispatch_only * 1e3);
    std::printf("  %-44s %9.2f ms\n", "  combine alone", combine_only * 1e3);
    std::printf("  %-44s %9.2f ms\n", "one process, same tokens, nothing exchanged", local * 1e3);
    std::printf("  %-44s %9.2f ms\n", "  the same, forward and backward", local_backward * 1e3);
    std::printf(
        "  bytes saved by deduplication: %.1f%% (%.3f GB per rank per layer round trip)\n",
        100.0 * (1.0 - static_cast<double>(same_bytes.send_rows) / undeduplicated.send_rows),
        gb(undeduplicated.send_rows) - gb(same_bytes.send_rows));
    std::printf("  throughput ratio vs bare of the same bytes: %.2f\n", bare_pairs / ours);
    std::printf("  the same, less the one-process time (what going expert-parallel adds): %.2f\n",
                bare_pairs / std::max(ours - local, 1e-9));
    std::printf("  time ratio vs bare without deduplication:   %.2f\n\n", bare_slots / ours);
  }
}

struct StepTimes {
  double step = 0, expert = 0, comm = 0;  // seconds, mean per step, max over ranks
};

StepTimes TrainSteps(moefit::parallel::ProcessGroups& groups, const Flags& f, int64_t chunks) {
  using namespace moefit;
  auto config = launch::LoadConfig(
      "", {"train.steps=" + std::to_string(f.steps), "train.micro_batch_size=8",
           "logging.metrics_file=", "parallel.dispatch_chunks=" + std::to_string(chunks)});
  auto run = launch::ResolveConfig(*config);
  if (!run.ok()) parallel::AbortAll(1, run.status().ToString());
  run->runtime.expert_group = groups.expert_parallel;
  auto data = framework::TokenDataset::FromText(launch::ShippedCorpus(), run->seq_len, "corpus");
  auto model = framework::MoeModel::Create(run->model, run->runtime, run->train.seed);
  framework::Trainer trainer(**model, *data, run->train, &groups);
  std::ostringstream log;
  auto stats = trainer.Run(log);
  StepTimes t;
  int n = 0;
  for (size_t i = 1; i < stats->size(); ++i, ++n) {  // step 1 is warm-up
    t.step += (*stats)[i].seconds;
    t.expert += (*stats)[i].expert_seconds;
    t.comm += (*stats)[i].comm_seconds;
  }
  t.step = MaxOverRanks(t.step / n);
  t.expert = MaxOverRanks(t.expert / n);
  t.comm = MaxOverRanks(t.comm / n);
  return t;
}

void StepSplit(moefit::parallel::ProcessGroups& groups, const Flags& f) {
  const bool print = groups.world->rank() == 0;
  if (print) {
    std::printf(
        "training step of the demo model (%d ranks, 8 x 128 tokens per rank), mean of %ld "
        "steps after one:\n",
        groups.world->size(), static_cast<long>(f.steps - 1));
  }
  StepTimes one;
  for (int64_t chunks = 1; chunks <= std::max<int64_t>(f.max_chunks, 1); chunks *= 2) {
    const StepTimes t = TrainSteps(groups, f, chunks);
    if (chunks == 1) one = t;
    if (!print) continue;
    const double dense = t.step - t.expert - t.comm;
    std::printf(
        "  %ld chunk%s: step %.1f ms = dense %.1f ms (%.0f%%) + expert %.1f ms (%.0f%%) + "
        "communication %.1f ms (%.0f%%)",
        static_cast<long>(chunks), chunks == 1 ? " " : "s", t.step * 1e3, dense * 1e3,
        100 * dense / t.step, t.expert * 1e3, 100 * t.expert / t.step, t.comm * 1e3,
        100 * t.comm / t.step);
    if (chunks > 1) {
      std::printf("; communication hidden %.0f%%, step %.2fx", 100 * (one.comm - t.comm) / one.comm,
                  one.step / t.step);
    }
    std::printf("\n");
  }
}

// Part 3: the counted bytes.
void CountedBytes(moefit::parallel::ProcessGroups& groups, const Flags& f) {
  using namespace moefit;
  const int rank = groups.world->rank();
  if (rank == 0) {
    std::printf("bytes that cross between ranks (%d ranks), counted, summed over ranks:\n",
                groups.world->size());
  }
  bench::PrintTraffic(rank,
                      "uniform routing as above, hidden " + std::to_string(f.hidden) + " fp32",
                      bench::CountUniformLayer(groups.expert_parallel, f.tokens, f.hidden, f.top_k,
                                               f.experts, at::kFloat, 7));
  if (f.steps <= 1) return;
  // One step of part 2's demo model (as initialized), on its first global batch.
  auto config = launch::LoadConfig("", {"train.micro_batch_size=8", "logging.metrics_file="});
  auto run = launch::ResolveConfig(*config);
  if (!run.ok()) parallel::AbortAll(1, run.status().ToString());
  auto counting = parallel::CountingCommunicator::Create(groups.expert_parallel);
  run->runtime.expert_group = counting;
  auto data = framework::TokenDataset::FromText(launch::ShippedCorpus(), run->seq_len, "corpus");
  auto model = framework::MoeModel::Create(run->model, run->runtime, run->train.seed);
  if (!data.ok() || !model.ok()) parallel::AbortAll(1, "cannot build the demo model");
  const int64_t per_rank = run->train.micro_batch_size, world = groups.world->size();
  framework::BatchSampler sampler(data->num_sequences(), run->train.seed);
  const std::vector<int64_t> global = sampler.GlobalBatch(0, per_rank * world);
  const std::vector<int64_t> mine(global.begin() + per_rank * rank,
                                  global.begin() + per_rank * (rank + 1));
  const framework::ModelOptions& o = (*model)->options();
  bench::PrintTraffic(
      rank,
      "a training step of the demo model, top-" + std::to_string(o.num_experts_per_tok) + " of " +
          std::to_string(o.num_experts) + " experts, hidden " + std::to_string(o.hidden_size),
      bench::CountModelStep(**model, *counting, *groups.world, data->Gather(mine)));
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moefit;
  const Flags f = ParseFlags(argc, argv);
  auto runtime = parallel::MpiRuntime::Start(
      &argc, &argv,
      {.required_thread_level = f.progress_us > 0 ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED});
  if (!runtime.ok()) return 1;
  std::unique_ptr<parallel::MpiProgressThread> progress;
  if (f.progress_us > 0) {
    auto started = parallel::MpiProgressThread::Start(absl::Microseconds(f.progress_us));
    if (!started.ok()) parallel::AbortAll(1, started.status().ToString());
    progress = std::move(*started);
  }
  auto world = parallel::MpiCommunicator::Create(MPI_COMM_WORLD);
  auto groups = parallel::MakeProcessGroups(*world, {});
  if (!groups.ok()) parallel::AbortAll(1, groups.status().ToString());
  if (world.value()->rank() == 0 && f.progress_us > 0) {
    std::printf("MPI progress thread every %ld us while collectives are in flight\n\n",
                static_cast<long>(f.progress_us));
  }
  try {
    DispatchVersusAlltoallv(*groups, f);
    if (f.steps > 1) StepSplit(*groups, f);
    CountedBytes(*groups, f);
  } catch (const std::exception& e) {
    parallel::AbortAll(1, e.what());
  }
  return 0;
}
