// Counted token-exchange bytes; see step_traffic.h.
#include "benchmarks/parallel/step_traffic.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstdio>
#include <utility>

#include "parallel/dispatcher.h"
#include "parallel/mpi_runtime.h"

namespace moefit::bench {
namespace {

constexpr int64_t kIndexBytes = 8;   // int64 counts and local expert indices
constexpr int64_t kWeightBytes = 4;  // float32 routing weights

// Element bytes of the combine's sums: the rows' dtype promoted to at least float32.
int64_t SumBytes(at::ScalarType dtype) {
  return static_cast<int64_t>(c10::elementSize(at::promoteTypes(dtype, at::kFloat)));
}

// The undeduplicated exchange of one layer for this rank's tokens:
// `slots_to[q]` of their (token, slot) assignments are to experts of rank q,
// each a row of `row_bytes` there and one back, forward and again backward.
ExchangeBytes Undeduplicated(const std::vector<int64_t>& slots_to, int self,
                             int64_t experts_per_rank, int64_t row_bytes) {
  const int64_t peers = static_cast<int64_t>(slots_to.size()) - 1;
  ExchangeBytes b;
  for (size_t q = 0; q < slots_to.size(); ++q) {
    if (static_cast<int>(q) != self) b.rows += slots_to[q];
  }
  b.forward = peers * experts_per_rank * kIndexBytes + 2 * b.rows * row_bytes;
  b.backward = 2 * b.rows * row_bytes;
  return b;
}

// What `counting` counted between two snapshots, as after-deduplication bytes:
// forward and backward bytes out, and the rows, from the forward's local
// expert indices (k of them, int64, with every row: AllToAllV's bytes).
ExchangeBytes Deduplicated(const parallel::CountingCommunicator& counting,
                           const parallel::TrafficCount& forward,
                           const parallel::TrafficCount& forward_indices, int64_t top_k) {
  parallel::TrafficCount backward = counting.total();
  backward -= forward;
  ExchangeBytes b;
  b.rows = forward_indices.bytes_out / (top_k * kIndexBytes);
  b.forward = forward.bytes_out;
  b.backward = backward.bytes_out;
  return b;
}

parallel::TrafficCount IndicesSoFar(const parallel::CountingCommunicator& counting) {
  const auto counts = counting.counts();
  const auto it = counts.find("AllToAllV");
  return it == counts.end() ? parallel::TrafficCount{} : it->second;
}

// Every rank's numbers summed, on every rank.
StepTraffic SumOverRanks(parallel::Communicator& world, const StepTraffic& mine) {
  at::Tensor v = at::tensor({mine.before.rows, mine.before.forward, mine.before.backward,
                             mine.after.rows, mine.after.forward, mine.after.backward, mine.tokens},
                            at::kLong);
  world.AllReduce(v, parallel::ReduceOp::kSum)->WaitOrThrow();
  const int64_t* p = v.data_ptr<int64_t>();
  StepTraffic t;
  t.before = {.rows = p[0], .forward = p[1], .backward = p[2]};
  t.after = {.rows = p[3], .forward = p[4], .backward = p[5]};
  t.tokens = p[6];
  t.layers = mine.layers;
  return t;
}

std::vector<int64_t> PerOwner(const at::Tensor& per_expert,
                              const router::ExpertPlacement& placement) {
  const at::Tensor counts = per_expert.to(at::kDouble).contiguous();
  const double* c = counts.data_ptr<double>();
  std::vector<int64_t> per_owner(placement.ep_size(), 0);
  for (int64_t e = 0; e < counts.numel(); ++e) {
    per_owner[placement.owner(e)] += static_cast<int64_t>(c[e] + 0.5);
  }
  return per_owner;
}

}  // namespace

ExchangeBytes& ExchangeBytes::operator+=(const ExchangeBytes& o) {
  rows += o.rows;
  forward += o.forward;
  backward += o.backward;
  return *this;
}

StepTraffic CountUniformLayer(const std::shared_ptr<parallel::Communicator>& world,
                              int64_t tokens_per_rank, int64_t hidden, int64_t top_k,
                              int64_t num_experts, at::ScalarType dtype, uint64_t seed) {
  const int num_ranks = world->size(), self = world->rank();
  absl::StatusOr<router::ExpertPlacement> placement =
      router::ExpertPlacement::Contiguous(num_experts, num_ranks);
  if (!placement.ok()) parallel::AbortAll(1, placement.status().ToString());
  auto counting = parallel::CountingCommunicator::Create(world);
  auto dispatcher = parallel::CreateDispatcher("alltoall", counting, *placement);
  if (!dispatcher.ok()) parallel::AbortAll(1, dispatcher.status().ToString());

  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed + self);
  const at::Tensor idx =
      std::get<1>(at::rand({tokens_per_rank, num_experts}, gen).topk(top_k, 1)).contiguous();
  const at::Tensor x = at::randn({tokens_per_rank, hidden}, gen).to(dtype).requires_grad_(true);
  const at::Tensor weight =
      at::softmax(at::randn({tokens_per_rank, top_k}, gen), 1).requires_grad_(true);
  std::vector<int64_t> slots_to(num_ranks, 0), pairs_to(num_ranks, 0);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens_per_rank; ++t) {
    std::vector<bool> seen(num_ranks, false);
    for (int64_t j = 0; j < top_k; ++j) {
      const int q = placement->owner(ip[t * top_k + j]);
      ++slots_to[q];
      if (!seen[q]) ++pairs_to[q];
      seen[q] = true;
    }
  }

  c10::AutoGradMode grad_mode(true);
  parallel::DispatchedRows d = (*dispatcher)->Dispatch(x, idx, weight);
  const at::Tensor back = (*dispatcher)->Combine(d.rows.index_select(0, d.row_index), *d.route);
  const parallel::TrafficCount forward = counting->total();
  const parallel::TrafficCount indices = IndicesSoFar(*counting);
  back.backward(at::randn(back.sizes(), gen).to(back.scalar_type()));

  const int64_t row_bytes = hidden * static_cast<int64_t>(c10::elementSize(dtype));
  StepTraffic mine;
  mine.before = Undeduplicated(slots_to, self, placement->max_local(), row_bytes);
  mine.after = Deduplicated(*counting, forward, indices, top_k);
  mine.tokens = tokens_per_rank;
  mine.layers = 1;
  StepTraffic all = SumOverRanks(*world, mine);

  // What the pairs predict: counts, then per pair its row, weights and
  // indices there and its sum back; backward the sum's gradient there, the
  // row's and the weights' gradients back.
  int64_t pairs = 0;
  for (int q = 0; q < num_ranks; ++q) pairs += q == self ? 0 : pairs_to[q];
  at::Tensor p = at::tensor({pairs}, at::kLong);
  world->AllReduce(p, parallel::ReduceOp::kSum)->WaitOrThrow();
  pairs = p.item<int64_t>();
  const int64_t sum_row = hidden * SumBytes(dtype);
  const int64_t expected_forward = int64_t{num_ranks} * (num_ranks - 1) * kIndexBytes +
                                   pairs * (row_bytes + top_k * (kWeightBytes + kIndexBytes)) +
                                   pairs * sum_row;
  const int64_t expected_backward = pairs * sum_row + pairs * (row_bytes + top_k * kWeightBytes);
  if (all.after.rows != pairs || all.after.forward != expected_forward ||
      all.after.backward != expected_backward) {
    parallel::AbortAll(1, "counted " + std::to_string(all.after.rows) + " rows, " +
                              std::to_string(all.after.forward) + " B forward, " +
                              std::to_string(all.after.backward) +
                              " B backward; the pairs predict " + std::to_string(pairs) + ", " +
                              std::to_string(expected_forward) + ", " +
                              std::to_string(expected_backward));
  }
  return all;
}

StepTraffic CountModelStep(framework::MoeModel& model, parallel::CountingCommunicator& counting,
                           parallel::Communicator& world, const framework::Batch& batch) {
  const framework::ModelOptions& o = model.options();
  counting.Reset();
  c10::AutoGradMode grad_mode(true);
  framework::ForwardResult out =
      model.Forward(batch.input_ids, batch.position_ids, batch.segment_ids);
  const parallel::TrafficCount forward = counting.total();
  const parallel::TrafficCount indices = IndicesSoFar(counting);
  const int64_t vocab = out.logits.size(-1);
  const at::Tensor logits = out.logits.narrow(1, 0, out.logits.size(1) - 1).reshape({-1, vocab});
  const at::Tensor labels =
      batch.labels.narrow(1, 1, batch.labels.size(1) - 1).reshape({-1}).to(logits.device());
  at::cross_entropy_loss(logits, labels, {}, at::Reduction::Sum, framework::kIgnoreIndex)
      .backward();

  const int64_t row_bytes =
      o.hidden_size *
      static_cast<int64_t>(c10::elementSize(model.runtime().expert_compute_dtype()));
  StepTraffic mine;
  for (const framework::MoeLayerRouting& layer : out.moe_layers) {
    mine.before += Undeduplicated(PerOwner(layer.expert_count, model.placement()), world.rank(),
                                  model.placement().max_local(), row_bytes);
  }
  mine.after = Deduplicated(counting, forward, indices, o.num_experts_per_tok);
  mine.tokens = batch.input_ids.numel();
  mine.layers = static_cast<int64_t>(out.moe_layers.size());
  return SumOverRanks(world, mine);
}

void PrintTraffic(int rank, const std::string& label, const StepTraffic& t) {
  if (rank != 0) return;
  auto mib = [](int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); };
  auto line = [&](const char* what, const ExchangeBytes& b) {
    std::printf(
        "    %-6s %9ld rows  forward %9.3f MiB  backward %9.3f MiB  step %9.3f MiB (%ld B)\n", what,
        static_cast<long>(b.rows), mib(b.forward), mib(b.backward), mib(b.total()),
        static_cast<long>(b.total()));
  };
  std::printf("  %s (%ld tokens, %ld MoE layer%s):\n", label.c_str(), static_cast<long>(t.tokens),
              static_cast<long>(t.layers), t.layers == 1 ? "" : "s");
  line("before", t.before);
  line("after", t.after);
  auto less = [](int64_t after, int64_t before) {
    return before > 0 ? 100.0 * (1.0 - static_cast<double>(after) / before) : 0.0;
  };
  std::printf(
      "    deduplication: %.1f%% fewer rows, %.1f%% fewer bytes (forward %.1f%%, "
      "backward %.1f%%)\n",
      less(t.after.rows, t.before.rows), less(t.after.total(), t.before.total()),
      less(t.after.forward, t.before.forward), less(t.after.backward, t.before.backward));
}

}  // namespace moefit::bench
