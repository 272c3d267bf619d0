// Dispatch and combine under random routing on 2 and 4 ranks: every row reaches
// the owner of its expert and comes back weighted; a token travels once per
// owner rank; alltoall and allgather agree on outputs and gradients, the
// routing weights' included; the pipelined run over token chunks equals one
// chunk; the bytes that cross between ranks, counted, are one row per
// (token, owner rank) each way. Includes a rank that sends nothing (no tokens)
// and an expert that receives nothing, with an expert count that does not
// divide.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "parallel/counting_communicator.h"
#include "parallel/dispatcher.h"
#include "tests/parallel/mpi_test_env.h"

namespace moefit::parallel {
namespace {

struct Case {
  at::Tensor x;            // [N, H]
  at::Tensor topk_idx;     // [N, k]
  at::Tensor topk_weight;  // [N, k]
};

constexpr int64_t kHidden = 6;
constexpr int64_t kTopK = 3;

// Rank 1 has no tokens, rank r != 1 has 5 + 7r, each routed uniformly to
// experts 1..E-1: expert 0 never receives anything.
Case MakeCase(int rank, int64_t num_experts) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(100 + rank);
  const int64_t n = rank == 1 ? 0 : 5 + 7 * rank;
  Case c;
  c.x = at::randn({n, kHidden}, gen, at::kDouble);
  // Distinct experts per token (top-k never repeats an expert).
  c.topk_idx = at::empty({n, kTopK}, at::kLong);
  for (int64_t t = 0; t < n; ++t) {
    at::Tensor perm = at::randperm(num_experts - 1, gen, at::kLong).narrow(0, 0, kTopK) + 1;
    c.topk_idx[t].copy_(perm);
  }
  c.topk_weight = at::rand({n, kTopK}, gen, at::kDouble);
  return c;
}

// What every case starts from: 2 x ranks + 1 experts (a count that does not
// divide; at least k + 1, so that experts 1..E-1 hold a token's k) placed
// contiguously over the world, this rank's tokens, and the experts it owns.
struct DispatchSetup {
  std::shared_ptr<MpiCommunicator> world;
  router::ExpertPlacement placement;
  Case c;
  int64_t first_expert = 0, num_local = 0;

  std::unique_ptr<Dispatcher> Create(const std::string& name) const {
    absl::StatusOr<std::unique_ptr<Dispatcher>> d = CreateDispatcher(name, world, placement);
    TORCH_CHECK(d.ok(), d.status().ToString());
    return *std::move(d);
  }
};

DispatchSetup MakeSetup() {
  auto world = testing::World();
  const int64_t num_experts = std::max<int64_t>(2 * world->size() + 1, kTopK + 1);
  absl::StatusOr<router::ExpertPlacement> placement =
      router::ExpertPlacement::Contiguous(num_experts, world->size());
  TORCH_CHECK(placement.ok(), placement.status().ToString());
  DispatchSetup s{world, *placement, MakeCase(world->rank(), num_experts)};
  s.first_expert = placement->first_expert(world->rank());
  s.num_local = placement->num_local(world->rank());
  return s;
}

// "Expert e" multiplies its rows (read by index from the received ones) by
// (e + 1): the result tells which expert a row visited.
at::Tensor FakeExperts(const DispatchedRows& d, int64_t first_expert, int64_t num_local) {
  const at::Tensor rows = d.rows.index_select(0, d.row_index);
  std::vector<at::Tensor> parts;
  int64_t row = 0;
  for (size_t s = 0; s < d.counts.size(); ++s) {
    const int64_t e = static_cast<int64_t>(s) % num_local;
    parts.push_back(rows.narrow(0, row, d.counts[s]) * static_cast<double>(first_expert + e + 1));
    row += d.counts[s];
  }
  return parts.empty() ? rows * 1.0 : at::cat(parts);
}

// row_copies is row_index inverted: each computation row a is listed once,
// under the received row it reads.
void ExpectCopiesInvertIndex(const DispatchedRows& d) {
  const int64_t a_rows = d.row_index.numel();
  ASSERT_EQ(d.row_copies.size(0), d.rows.size(0));
  std::vector<int> seen(a_rows, 0);
  for (int64_t r = 0; r < d.row_copies.size(0); ++r) {
    for (int64_t j = 0; j < d.row_copies.size(1); ++j) {
      const int64_t a = d.row_copies[r][j].item<int64_t>();
      if (a < 0) continue;
      ASSERT_LT(a, a_rows);
      EXPECT_EQ(d.row_index[a].item<int64_t>(), r);
      ++seen[a];
    }
  }
  for (int64_t a = 0; a < a_rows; ++a) EXPECT_EQ(seen[a], 1) << "computation row " << a;
}

class DispatchTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DispatchTest, RowsReachTheirExpertsAndComeBack) {
  const DispatchSetup s = MakeSetup();
  const auto& world = s.world;
  const Case& c = s.c;
  const int64_t num_experts = s.placement.num_experts();
  const std::unique_ptr<Dispatcher> dispatcher = s.Create(GetParam());

  DispatchedRows d = dispatcher->Dispatch(c.x, c.topk_idx, c.topk_weight);
  // Rows per local expert = global assignments to that expert.
  at::Tensor global_counts = at::bincount(c.topk_idx.reshape({-1}), {}, num_experts);
  world->AllReduce(global_counts, ReduceOp::kSum)->WaitOrThrow();
  const int64_t first = s.first_expert;
  const int64_t num_local = s.num_local;
  // EXPECT, not ASSERT, here and below until the last collective: a rank that
  // returned early would leave the others waiting (mpi_test_env.h).
  const int64_t counted = static_cast<int64_t>(d.counts.size());
  EXPECT_EQ(counted, num_local);
  ExpectCopiesInvertIndex(d);
  for (int64_t e = 0; e < std::min(counted, num_local); ++e) {
    EXPECT_EQ(d.counts[e], global_counts[first + e].item<int64_t>()) << "local expert " << e;
  }
  if (world->rank() == 0 && counted > 0) {
    EXPECT_EQ(d.counts[0], 0);  // expert 0 receives nothing
  }
  if (GetParam() == "alltoall") {  // one row per (token, owner rank) pair
    at::Tensor owner = at::empty_like(c.topk_idx);
    for (int64_t i = 0; i < c.topk_idx.numel(); ++i) {
      owner.view({-1})[i] = s.placement.owner(c.topk_idx.view({-1})[i].item<int64_t>());
    }
    int64_t pairs = 0;
    for (int64_t t = 0; t < c.x.size(0); ++t) pairs += std::get<0>(at::_unique(owner[t])).numel();
    EXPECT_EQ(d.sent_rows, pairs);
    EXPECT_LE(d.sent_rows, c.x.size(0) * kTopK);
    // Received once per (token, this rank) pair: the rows sent here in all.
    at::Tensor to_rank = at::zeros({world->size()}, at::kLong);
    for (int64_t t = 0; t < c.x.size(0); ++t) {
      for (int q = 0; q < world->size(); ++q) {
        if ((owner[t] == q).any().item<bool>()) to_rank[q] += 1;
      }
    }
    world->AllReduce(to_rank, ReduceOp::kSum)->WaitOrThrow();
    EXPECT_EQ(d.rows.size(0), to_rank[world->rank()].item<int64_t>()) << "rank " << world->rank();
  } else {  // one row per token of any rank that visits one of this rank's experts
    at::Tensor counts = at::tensor({c.x.size(0)}, at::kLong);
    at::Tensor all_counts = at::empty({world->size()}, at::kLong);
    world->AllGather(counts, all_counts)->WaitOrThrow();
    std::vector<int64_t> tokens(all_counts.data_ptr<int64_t>(),
                                all_counts.data_ptr<int64_t>() + world->size());
    at::Tensor all_idx = at::empty({all_counts.sum().item<int64_t>(), kTopK}, at::kLong);
    world->AllGatherV(c.topk_idx.contiguous(), all_idx, tokens)->WaitOrThrow();
    const at::Tensor mine = all_idx.ge(first).logical_and(all_idx.lt(first + num_local));
    EXPECT_EQ(d.rows.size(0), mine.any(1).sum().item<int64_t>()) << "rank " << world->rank();
  }

  at::Tensor back = dispatcher->Combine(FakeExperts(d, first, num_local), *d.route);
  ASSERT_EQ(back.sizes(), c.x.sizes());
  at::Tensor scale = (c.topk_weight * (c.topk_idx.to(at::kDouble) + 1)).sum(1, /*keepdim=*/true);
  EXPECT_TRUE(at::allclose(back, c.x * scale, 1e-13, 1e-13)) << "rank " << world->rank();
}

INSTANTIATE_TEST_SUITE_P(Dispatchers, DispatchTest, ::testing::Values("alltoall", "allgather"));

TEST(Dispatchers, AllToAllAndAllGatherAgreeOnOutputsAndGradients) {
  const DispatchSetup s = MakeSetup();
  const Case& c = s.c;
  at::Tensor upstream = at::randn({c.x.size(0), kHidden}, at::kDouble);
  // The same stand-in expert weight on every rank.
  at::Tensor weight =
      at::randn({kHidden, kHidden}, at::make_generator<at::CPUGeneratorImpl>(5), at::kDouble);
  std::vector<at::Tensor> outs, grads, weight_grads;
  for (const char* name : {"alltoall", "allgather"}) {
    const std::unique_ptr<Dispatcher> dispatcher = s.Create(name);
    at::Tensor x = c.x.clone().requires_grad_(true);
    at::Tensor w = c.topk_weight.clone().requires_grad_(true);
    DispatchedRows d = dispatcher->Dispatch(x, c.topk_idx, w);
    // A differentiable stand-in for the experts: rows · W, scaled per expert.
    at::Tensor y = at::matmul(FakeExperts(d, s.first_expert, s.num_local), weight);
    at::Tensor back = dispatcher->Combine(y, *d.route);
    (back * upstream).sum().backward();
    outs.push_back(back.detach());
    grads.push_back(x.grad());
    weight_grads.push_back(w.grad());
  }
  EXPECT_TRUE(at::allclose(outs[0], outs[1], 1e-12, 1e-12));
  EXPECT_TRUE(at::allclose(grads[0], grads[1], 1e-12, 1e-12));
  EXPECT_TRUE(at::allclose(weight_grads[0], weight_grads[1], 1e-12, 1e-12));
  // The routing weights' gradient is each slot's expert output against the
  // upstream gradient: (x W (e + 1)) . upstream.
  at::Tensor expert_out =
      at::matmul(c.x, weight).unsqueeze(1) * (c.topk_idx.to(at::kDouble) + 1).unsqueeze(2);
  at::Tensor expected = (expert_out * upstream.unsqueeze(1)).sum(2);
  EXPECT_TRUE(at::allclose(weight_grads[0], expected, 1e-12, 1e-12))
      << "rank " << s.world->rank() << ": "
      << (weight_grads[0] - expected).abs().max().item<double>();
}

// The bytes that cross between ranks, counted by a CountingCommunicator under
// the alltoall dispatcher, are exactly one row per (token, owner rank) pair
// with its k routing weights and k local expert indices, and one summed row
// back: fewer than one row per (token, slot) each way. In backward the same
// rows go the opposite way (the routing weights' gradients with them, the
// indices not). Every rank's case is known everywhere (MakeCase), so each
// rank checks its bytes in as well as out.
TEST(Dispatchers, CountedBytesAreOneRowPerTokenAndOwnerRank) {
  const DispatchSetup s = MakeSetup();
  const int world = s.world->size(), self = s.world->rank();
  const int64_t num_experts = s.placement.num_experts();
  // pairs[r][q], slots[r][q]: rank r's (token, owner q) pairs and (token, slot)
  // assignments to q.
  std::vector<std::vector<int64_t>> pairs(world, std::vector<int64_t>(world, 0)), slots = pairs;
  for (int r = 0; r < world; ++r) {
    const Case c = MakeCase(r, num_experts);
    for (int64_t t = 0; t < c.topk_idx.size(0); ++t) {
      std::vector<bool> seen(world, false);
      for (int64_t j = 0; j < kTopK; ++j) {
        const int q = s.placement.owner(c.topk_idx[t][j].item<int64_t>());
        ++slots[r][q];
        if (!seen[q]) ++pairs[r][q];
        seen[q] = true;
      }
    }
  }
  int64_t pairs_out = 0, pairs_in = 0, slots_out = 0;
  for (int q = 0; q < world; ++q) {
    if (q == self) continue;
    pairs_out += pairs[self][q];
    pairs_in += pairs[q][self];
    slots_out += slots[self][q];
  }
  constexpr int64_t kDouble = 8, kIndex = 8;    // the case's rows and weights; int64 indices
  const int64_t counts = (world - 1) * kIndex;  // one count per peer (one chunk)
  const int64_t row = kHidden * kDouble, meta = kTopK * (kDouble + kIndex);

  auto counting = CountingCommunicator::Create(s.world);
  absl::StatusOr<std::unique_ptr<Dispatcher>> dispatcher =
      CreateDispatcher("alltoall", counting, s.placement);
  ASSERT_TRUE(dispatcher.ok()) << dispatcher.status();
  at::Tensor x = s.c.x.clone().requires_grad_(true);
  at::Tensor w = s.c.topk_weight.clone().requires_grad_(true);
  DispatchedRows d = (*dispatcher)->Dispatch(x, s.c.topk_idx, w);
  at::Tensor back = (*dispatcher)->Combine(FakeExperts(d, s.first_expert, s.num_local), *d.route);
  const TrafficCount forward = counting->total();
  back.sum().backward();
  TrafficCount backward = counting->total();
  backward -= forward;

  const std::string what = "rank " + std::to_string(self) + " of " + std::to_string(world);
  EXPECT_EQ(forward.bytes_out, counts + pairs_out * (row + meta) + pairs_in * row) << what;
  EXPECT_EQ(forward.bytes_in, counts + pairs_in * (row + meta) + pairs_out * row) << what;
  EXPECT_EQ(backward.bytes_out, pairs_out * row + pairs_in * (row + kTopK * kDouble)) << what;
  EXPECT_EQ(backward.bytes_in, pairs_in * row + pairs_out * (row + kTopK * kDouble)) << what;
  EXPECT_EQ(backward.calls, world == 1 ? 0 : 3) << what;  // rows' and weights' gradients back
  // Nothing but all-to-alls, and deduplication moved fewer rows than slots.
  EXPECT_EQ(counting->total().payload_bytes, 0) << what;
  EXPECT_LE(pairs_out, slots_out) << what;
  int64_t all_pairs = 0, all_slots = 0;  // crossing, over every rank
  for (int r = 0; r < world; ++r) {
    for (int q = 0; q < world; ++q) {
      if (q == r) continue;
      all_pairs += pairs[r][q];
      all_slots += slots[r][q];
    }
  }
  if (world > 1) {
    EXPECT_LT(all_pairs, all_slots);
  }
}

// Dispatcher::Run over 2, 3 and 16 chunks (more than some ranks' tokens, so
// some chunks are empty) equals one chunk: outputs, gradients of the tokens,
// of the routing weights and of a stand-in expert weight. The alltoall
// dispatcher pipelines the chunks (several exchanges in flight at once, their
// backward posted and received in the mirrored order); allgather runs them in
// turn.
class RunChunksTest : public ::testing::TestWithParam<std::string> {};

TEST_P(RunChunksTest, PipelinedChunksEqualOneChunk) {
  const DispatchSetup s = MakeSetup();
  const Case& c = s.c;
  const std::unique_ptr<Dispatcher> dispatcher = s.Create(GetParam());
  at::Tensor upstream = at::randn({c.x.size(0), kHidden}, at::kDouble);
  at::Tensor weight_init =
      at::randn({kHidden, kHidden}, at::make_generator<at::CPUGeneratorImpl>(5), at::kDouble);
  struct Result {
    at::Tensor out, x_grad, w_grad, weight_grad;
  };
  auto run = [&](int64_t chunks) {
    at::Tensor x = c.x.clone().requires_grad_(true);
    at::Tensor w = c.topk_weight.clone().requires_grad_(true);
    at::Tensor weight = weight_init.clone().requires_grad_(true);
    int64_t calls = 0;
    at::Tensor back = dispatcher->Run(x, c.topk_idx, w, chunks, [&](const DispatchedRows& d) {
      ++calls;
      ExpectCopiesInvertIndex(d);
      return at::matmul(FakeExperts(d, s.first_expert, s.num_local), weight);
    });
    EXPECT_EQ(calls, chunks);
    (back * upstream).sum().backward();
    return Result{back.detach(), x.grad(), w.grad(), weight.grad()};
  };
  // Every rank runs every chunk count, whatever it finds (mpi_test_env.h).
  const Result one = run(1);
  EXPECT_EQ(one.out.sizes(), c.x.sizes());
  for (int64_t chunks : {2, 3, 16}) {
    const Result many = run(chunks);
    const std::string what =
        "rank " + std::to_string(s.world->rank()) + ", " + std::to_string(chunks) + " chunks";
    EXPECT_EQ(many.out.sizes(), one.out.sizes()) << what;
    if (many.out.sizes() != one.out.sizes()) continue;
    EXPECT_TRUE(at::allclose(many.out, one.out, 1e-13, 1e-13)) << what;
    EXPECT_TRUE(at::allclose(many.x_grad, one.x_grad, 1e-13, 1e-13)) << what;
    EXPECT_TRUE(at::allclose(many.w_grad, one.w_grad, 1e-13, 1e-13)) << what;
    // Summed over the chunks' rows in another order.
    EXPECT_TRUE(at::allclose(many.weight_grad, one.weight_grad, 1e-12, 1e-12)) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Dispatchers, RunChunksTest, ::testing::Values("alltoall", "allgather"));

}  // namespace
}  // namespace moefit::parallel
