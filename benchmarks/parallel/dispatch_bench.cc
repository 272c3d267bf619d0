// Expert-parallel communication under mpirun (2 processes by default):
//
//  1. Dispatch + combine of the alltoall dispatcher against a bare
//     MPI_Alltoallv moving the same byte counts there and back, in the same
//     run (throughput ratio; goal >= 0.8), and beside the communicator's own
//     row all-to-all. The dispatcher's extra work is the counts exchange, the
//     sort by (owner, local expert), the gather of rows before sending and the
//     un-sort after combine.
//  2. One training step of a small MoE model split into dense compute, expert
//     compute and communication (time blocked in collectives), averaged over
//     steps after a warm-up.
//
//   mpirun -np 2 --oversubscribe build/benchmarks/dispatch_bench [--tokens=4096]
//        [--hidden=2048] [--top_k=8] [--experts=32] [--reps=10] [--steps=6]
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <sstream>
#include <vector>

#include "framework/data.h"
#include "framework/model.h"
#include "framework/trainer.h"
#include "launch/config.h"
#include "launch/corpus.h"
#include "parallel/dispatcher.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_runtime.h"
#include "parallel/process_groups.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  int64_t tokens = 4096, hidden = 2048, top_k = 8, experts = 32, reps = 10, steps = 6;
};

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    auto take = [&](const char* name, int64_t* out) {
      const size_t n = std::strlen(name);
      if (std::strncmp(argv[i], name, n) == 0 && argv[i][n] == '=') *out = std::atoll(argv[i] + n + 1);
    };
    take("--tokens", &f.tokens);
    take("--hidden", &f.hidden);
    take("--top_k", &f.top_k);
    take("--experts", &f.experts);
    take("--reps", &f.reps);
    take("--steps", &f.steps);
  }
  return f;
}

double MaxOverRanks(double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return v;
}

void DispatchVersusAlltoallv(moefit::parallel::ProcessGroups& groups, const Flags& f) {
  using namespace moefit;
  auto& ep = groups.expert_parallel;
  const int world = ep->size(), rank = ep->rank();
  auto placement = router::ExpertPlacement::Contiguous(f.experts, world);
  auto dispatcher = parallel::CreateDispatcher("alltoall", ep, *placement);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7 + rank);
  at::Tensor x = at::randn({f.tokens, f.hidden}, gen, at::kFloat);
  at::Tensor idx = at::randint(f.experts, {f.tokens, f.top_k}, gen, at::kLong);

  // The byte counts the dispatcher sends: rows per owner rank.
  at::Tensor owner = at::empty({f.experts}, at::kInt);
  for (int64_t e = 0; e < f.experts; ++e) owner[e] = placement->owner(e);
  at::Tensor rows_to = at::bincount(owner.to(at::kLong).index_select(0, idx.reshape({-1})), {}, world);
  std::vector<int> send(world), recv(world), sdispl(world), rdispl(world);
  for (int q = 0; q < world; ++q) send[q] = static_cast<int>(rows_to[q].item<int64_t>() * f.hidden);
  MPI_Alltoall(send.data(), 1, MPI_INT, recv.data(), 1, MPI_INT, MPI_COMM_WORLD);
  std::partial_sum(send.begin(), send.end() - 1, sdispl.begin() + 1);
  std::partial_sum(recv.begin(), recv.end() - 1, rdispl.begin() + 1);
  const int64_t send_total = std::accumulate(send.begin(), send.end(), int64_t{0});
  const int64_t recv_total = std::accumulate(recv.begin(), recv.end(), int64_t{0});
  std::vector<float> sbuf(send_total, 1.0f), rbuf(recv_total);

  torch::NoGradGuard no_grad;
  auto time_it = [&](auto&& fn) {
    fn();  // warm-up
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = Clock::now();
    for (int64_t r = 0; r < f.reps; ++r) fn();
    return MaxOverRanks(std::chrono::duration<double>(Clock::now() - t0).count() / f.reps);
  };
  const double bare = time_it([&] {
    MPI_Alltoallv(sbuf.data(), send.data(), sdispl.data(), MPI_FLOAT, rbuf.data(), recv.data(),
                  rdispl.data(), MPI_FLOAT, MPI_COMM_WORLD);
    MPI_Alltoallv(rbuf.data(), recv.data(), rdispl.data(), MPI_FLOAT, sbuf.data(), send.data(),
                  sdispl.data(), MPI_FLOAT, MPI_COMM_WORLD);
  });
  // The communicator's own row all-to-all on the same counts, no dispatch work.
  std::vector<int64_t> send_rows(world), recv_rows(world);
  for (int q = 0; q < world; ++q) {
    send_rows[q] = send[q] / f.hidden;
    recv_rows[q] = recv[q] / f.hidden;
  }
  at::Tensor send_t = at::ones({send_total / f.hidden, f.hidden});
  at::Tensor recv_t = at::empty({recv_total / f.hidden, f.hidden});
  const double comm_only = time_it([&] {
    ep->AllToAllV(send_t, send_rows, recv_t, recv_rows)->WaitOrThrow();
    ep->AllToAllV(recv_t, recv_rows, send_t, send_rows)->WaitOrThrow();
  });
  const double ours = time_it([&] {
    parallel::DispatchedRows d = (*dispatcher)->Dispatch(x, idx);
    at::Tensor back = (*dispatcher)->Combine(d.rows, *d.route);
  });
  const double gbytes = 2.0 * static_cast<double>(send_total) * sizeof(float) / 1e9;
  if (rank == 0) {
    std::printf("dispatch+combine vs bare MPI_Alltoallv, %d ranks, %ld tokens/rank x top-%ld, "
                "hidden %ld fp32 (%.3f GB per rank per round trip)\n",
                world, (long)f.tokens, (long)f.top_k, (long)f.hidden, gbytes);
    std::printf("  %-28s %9.2f ms %8.2f GB/s\n", "bare MPI_Alltoallv x2", bare * 1e3, gbytes / bare);
    std::printf("  %-28s %9.2f ms %8.2f GB/s\n", "Communicator::AllToAllV x2", comm_only * 1e3,
                gbytes / comm_only);
    std::printf("  %-28s %9.2f ms %8.2f GB/s\n", "alltoall dispatch+combine", ours * 1e3, gbytes / ours);
    std::printf("  throughput ratio (dispatch / bare): %.2f\n\n", bare / ours);
  }
}

void StepSplit(moefit::parallel::ProcessGroups& groups, const Flags& f) {
  using namespace moefit;
  auto config = launch::LoadConfig("", {"train.steps=" + std::to_string(f.steps),
                                        "train.micro_batch_size=8", "logging.metrics_file="});
  auto run = launch::ResolveConfig(*config);
  run->runtime.expert_group = groups.expert_parallel;
  auto data = framework::TokenDataset::FromText(launch::ShippedCorpus(), run->seq_len, "corpus");
  auto model = framework::MoeModel::Create(run->model, run->runtime, run->train.seed);
  framework::Trainer trainer(**model, *data, run->train, &groups);
  std::ostringstream log;
  auto stats = trainer.Run(log);
  double step = 0, expert = 0, comm = 0;
  int n = 0;
  for (size_t i = 1; i < stats->size(); ++i, ++n) {  // step 1 is warm-up
    step += (*stats)[i].seconds;
    expert += (*stats)[i].expert_seconds;
    comm += (*stats)[i].comm_seconds;
  }
  step = MaxOverRanks(step / n);
  expert = MaxOverRanks(expert / n);
  comm = MaxOverRanks(comm / n);
  if (groups.world->rank() == 0) {
    std::printf("training step of the demo model (%d ranks, 8 x 128 tokens per rank), mean of %d steps:\n",
                groups.world->size(), n);
    std::printf("  step %.1f ms = dense %.1f ms (%.0f%%) + expert %.1f ms (%.0f%%) + communication %.1f ms (%.0f%%)\n",
                step * 1e3, (step - expert - comm) * 1e3, 100 * (step - expert - comm) / step,
                expert * 1e3, 100 * expert / step, comm * 1e3, 100 * comm / step);
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moefit;
  auto runtime = parallel::MpiRuntime::Start(&argc, &argv);
  if (!runtime.ok()) return 1;
  const Flags f = ParseFlags(argc, argv);
  auto world = parallel::MpiCommunicator::Create(MPI_COMM_WORLD);
  auto groups = parallel::MakeProcessGroups(*world, {});
  if (!groups.ok()) parallel::AbortAll(1, groups.status().ToString());
  try {
    DispatchVersusAlltoallv(*groups, f);
    StepSplit(*groups, f);
  } catch (const std::exception& e) {
    parallel::AbortAll(1, e.what());
  }
  return 0;
}
