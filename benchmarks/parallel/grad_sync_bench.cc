// How much of the dense-gradient all-reduce backward hides: the same
// forward + backward of a stack of linear layers, in one run,
//   1. alone (no gradient sum),
//   2. then the same buckets all posted after backward (OverlappedGradSync
//      armed only once backward is done: the same copies and buffers),
//   3. with the buckets all-reduced during backward (armed before it),
// and hidden = (t2 - t3) / (t2 - t1): the share of the all-reduce's time that
// no longer adds to the step. Also, for reference, 4. the after-backward
// twin parallel::AllReduceSum (which flattens into new buffers each time).
// Medians over rounds, the slowest rank's.
//
//   mpirun -np 2 --oversubscribe build/benchmarks/grad_sync_bench
//       [--layers=8 --hidden=1024 --rows=64 --bucket_mb=4 --rounds=7]
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "parallel/grad_sync.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_runtime.h"

namespace {

using namespace moefit;

struct Flags {
  int64_t layers = 8;
  int64_t hidden = 1024;
  int64_t rows = 64;
  double bucket_mb = 4;
  int rounds = 7;
};

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    const std::string name = a.substr(0, eq),
                      value = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (name == "--layers") {
      f.layers = std::atoll(value.c_str());
    } else if (name == "--hidden") {
      f.hidden = std::atoll(value.c_str());
    } else if (name == "--rows") {
      f.rows = std::atoll(value.c_str());
    } else if (name == "--bucket_mb") {
      f.bucket_mb = std::atof(value.c_str());
    } else if (name == "--rounds") {
      f.rounds = std::atoi(value.c_str());
    } else {
      std::fprintf(stderr, "grad_sync_bench: unknown flag '%s'\n", a.c_str());
      std::exit(2);
    }
  }
  if (f.layers < 1 || f.hidden < 1 || f.rows < 1 || !(f.bucket_mb > 0) || f.rounds < 1) {
    std::fprintf(stderr, "grad_sync_bench: every flag must be positive\n");
    std::exit(2);
  }
  return f;
}

double MaxOverRanks(parallel::Communicator& comm, double v) {
  at::Tensor t = at::full({1}, v, at::kDouble);
  comm.AllReduce(t, parallel::ReduceOp::kMax)->WaitOrThrow();
  return t.item<double>();
}

void Run(parallel::Communicator& world, const Flags& f) {
  at::manual_seed(1);
  std::vector<at::Tensor> params;
  for (int64_t l = 0; l < f.layers; ++l) {
    params.push_back((at::randn({f.hidden, f.hidden}) / std::sqrt(f.hidden)).requires_grad_());
    params.push_back(at::zeros({f.hidden}).requires_grad_());
  }
  at::manual_seed(10 + world.rank());
  const at::Tensor x = at::randn({f.rows, f.hidden});
  auto forward_backward = [&] {
    for (at::Tensor& p : params) p.mutable_grad() = at::Tensor();
    at::Tensor h = x;
    for (int64_t l = 0; l < f.layers; ++l)
      h = at::tanh(at::linear(h, params[2 * l], params[2 * l + 1]));
    h.square().sum().backward();
  };
  const parallel::GradSyncOptions options{.bucket_bytes =
                                              static_cast<int64_t>(f.bucket_mb * (1 << 20))};
  absl::StatusOr<std::unique_ptr<parallel::OverlappedGradSync>> sync =
      parallel::OverlappedGradSync::Create(world, params, options);
  if (!sync.ok()) parallel::AbortAll(1, sync.status().ToString());

  std::vector<std::function<void()>> ways;
  ways.push_back([&] { forward_backward(); });
  ways.push_back([&] {
    forward_backward();
    (*sync)->Arm();
    (*sync)->Finish();
  });
  ways.push_back([&] {
    (*sync)->Arm();
    forward_backward();
    (*sync)->Finish();
  });
  ways.push_back([&] {
    forward_backward();
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : params) grads.push_back(p.grad());
    parallel::AllReduceSum(world, grads, options);
  });
  std::vector<std::vector<double>> seconds(ways.size());
  double exposed = 0;
  int64_t posted = 0;
  for (int round = -1; round < f.rounds; ++round) {  // round -1 warms up
    for (size_t w = 0; w < ways.size(); ++w) {
      world.Barrier()->WaitOrThrow();
      const auto start = std::chrono::steady_clock::now();
      ways[w]();
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (round >= 0) seconds[w].push_back(MaxOverRanks(world, s));
    }
    if (round >= 0) {  // of way 3, the last to use the sync
      exposed += (*sync)->last_stats().finish_seconds / f.rounds;
      posted += (*sync)->last_stats().num_posted_during_backward;
    }
  }
  std::vector<double> median;
  for (std::vector<double>& s : seconds) {
    std::sort(s.begin(), s.end());
    median.push_back(s[s.size() / 2]);
  }
  const double allreduce = median[1] - median[0];
  if (world.rank() == 0) {
    const double mib = f.layers * (f.hidden * f.hidden + f.hidden) * 4.0 / (1 << 20);
    std::printf(
        "%d ranks, %lld layers of %lld x %lld (%.1f MiB of float32 gradients), %lld rows, "
        "%lld buckets of at most %.1f MiB; median of %d rounds, slowest rank:\n",
        world.size(), static_cast<long long>(f.layers), static_cast<long long>(f.hidden),
        static_cast<long long>(f.hidden), mib, static_cast<long long>(f.rows),
        static_cast<long long>((*sync)->last_stats().num_buckets), f.bucket_mb, f.rounds);
    std::printf("  forward + backward alone              %8.2f ms\n", median[0] * 1e3);
    std::printf("  + buckets all-reduced after backward  %8.2f ms (all-reduce %.2f ms)\n",
                median[1] * 1e3, allreduce * 1e3);
    std::printf(
        "  + buckets all-reduced during backward %8.2f ms (Finish waits %.2f ms on average; "
        "%.1f of %lld buckets posted during backward)\n",
        median[2] * 1e3, exposed * 1e3, static_cast<double>(posted) / f.rounds,
        static_cast<long long>((*sync)->last_stats().num_buckets));
    std::printf("  + AllReduceSum after backward         %8.2f ms (reference)\n", median[3] * 1e3);
    std::printf("  all-reduce time hidden behind backward: %.0f%%\n",
                allreduce > 0 ? 100 * (median[1] - median[2]) / allreduce : 0.0);
  }
}

}  // namespace

int main(int argc, char** argv) {
  auto runtime = parallel::MpiRuntime::Start(&argc, &argv);
  if (!runtime.ok()) return 1;
  const Flags f = ParseFlags(argc, argv);
  auto world = parallel::MpiCommunicator::Create(MPI_COMM_WORLD);
  if (!world.ok()) parallel::AbortAll(1, world.status().ToString());
  try {
    Run(**world, f);
  } catch (const std::exception& e) {
    parallel::AbortAll(1, e.what());
  }
  return 0;
}
