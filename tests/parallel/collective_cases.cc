// The shared collective cases (see the header).
#include "tests/parallel/collective_cases.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <numeric>
#include <string>

#include "absl/strings/str_cat.h"

namespace moefit::parallel::testing {
namespace {

// A run of rows all sent by `src` to `dst`.
struct RowBlock {
  int src = 0;
  int dst = 0;
  int64_t num_rows = 0;
};

int64_t NumRowElements(const std::vector<int64_t>& trailing_shape) {
  int64_t num_elements = 1;
  for (const int64_t size : trailing_shape) num_elements *= size;
  return num_elements;
}

// Rows [sum of num_rows, trailing...] holding Value(src, dst, row, col) block
// after block, built on the CPU and moved to `device`.
at::Tensor MakeRows(const std::vector<RowBlock>& blocks, const std::vector<int64_t>& trailing_shape,
                    at::ScalarType dtype, c10::Device device) {
  const int64_t num_row_elements = NumRowElements(trailing_shape);
  std::vector<float> values;
  int64_t num_rows = 0;
  for (const RowBlock& block : blocks) {
    for (int64_t row_idx = 0; row_idx < block.num_rows; ++row_idx) {
      for (int64_t col_idx = 0; col_idx < num_row_elements; ++col_idx) {
        values.push_back(static_cast<float>(Value(block.src, block.dst, row_idx, col_idx)));
      }
    }
    num_rows += block.num_rows;
  }
  std::vector<int64_t> shape = {num_rows};
  shape.insert(shape.end(), trailing_shape.begin(), trailing_shape.end());
  return at::tensor(values, at::kFloat).reshape(shape).to(dtype).to(device);
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t dim_idx = 0; dim_idx < shape.size(); ++dim_idx) {
    absl::StrAppend(&text, dim_idx == 0 ? "" : ", ", shape[dim_idx]);
  }
  return text + "]";
}

// Same dtype, shape and values; compared on the CPU in double (exact for the
// small integers the cases use).
void ExpectSameTensor(const at::Tensor& actual, const at::Tensor& expected,
                      const std::string& what) {
  const at::Tensor actual_cpu = actual.cpu();
  EXPECT_EQ(actual_cpu.scalar_type(), expected.scalar_type()) << what;
  EXPECT_EQ(actual_cpu.sizes(), expected.sizes()) << what;
  if (actual_cpu.sizes() != expected.sizes()) return;
  EXPECT_TRUE(at::equal(actual_cpu.to(at::kDouble), expected.cpu().to(at::kDouble)))
      << what << "\nactual:\n"
      << actual_cpu << "\nexpected:\n"
      << expected;
}

void ExpectOk(const std::shared_ptr<Work>& work, const std::string& what) {
  const absl::Status status = work->Wait();
  EXPECT_TRUE(status.ok()) << what << ": " << status;
  EXPECT_TRUE(work->IsCompleted()) << what;
}

at::TensorOptions On(const Communicator& comm, at::ScalarType dtype) {
  return at::TensorOptions().dtype(dtype).device(comm.device());
}

}  // namespace

std::vector<at::ScalarType> RowDtypes() { return {at::kFloat, at::kBFloat16, at::kLong}; }

std::vector<std::vector<int64_t>> TrailingShapes() { return {{}, {4}, {2, 3}}; }

int64_t Value(int src, int dst, int64_t row, int64_t col) {
  return (((src * 4 + dst % 4) * 4 + row % 4) * 4 + col % 4) % 256;
}

int64_t RowCount(int src, int dst) { return src == 1 ? 0 : (src + 2 * dst) % 3; }

void CheckAllToAllCounts(Communicator& comm, int64_t counts_per_peer) {
  const int num_ranks = comm.size();
  const int rank = comm.rank();
  // Rank r sends 100 r + 10 p + k to rank p; so rank q receives 100 s + 10 q + k from rank s.
  at::Tensor send = at::empty({num_ranks, counts_per_peer}, at::kLong);
  at::Tensor expected = at::empty({num_ranks, counts_per_peer}, at::kLong);
  for (int peer_idx = 0; peer_idx < num_ranks; ++peer_idx) {
    for (int64_t k = 0; k < counts_per_peer; ++k) {
      send[peer_idx][k] = 100 * rank + 10 * peer_idx + k;
      expected[peer_idx][k] = 100 * peer_idx + 10 * rank + k;
    }
  }
  if (counts_per_peer == 1) {  // the plain "one count per peer" form
    send = send.reshape({num_ranks});
    expected = expected.reshape({num_ranks});
  }
  const at::Tensor recv = at::full(expected.sizes(), -1, On(comm, at::kLong));
  const std::string what = absl::StrCat("AllToAllCounts, ", counts_per_peer, " per peer");
  ExpectOk(comm.AllToAllCounts(send.to(comm.device()), recv), what);
  ExpectSameTensor(recv, expected, what);
}

namespace {

// This rank's side of the all-to-all cases: the rows it sends each peer and
// the rows it should receive from each.
struct AllToAllPlan {
  std::vector<RowBlock> send_blocks, expected_blocks;
  std::vector<int64_t> send_row_counts, recv_row_counts;
};

AllToAllPlan AllToAllPlanOf(const Communicator& comm) {
  AllToAllPlan plan;
  const int rank = comm.rank();
  for (int peer_idx = 0; peer_idx < comm.size(); ++peer_idx) {
    plan.send_blocks.push_back({rank, peer_idx, RowCount(rank, peer_idx)});
    plan.expected_blocks.push_back({peer_idx, rank, RowCount(peer_idx, rank)});
    plan.send_row_counts.push_back(RowCount(rank, peer_idx));
    plan.recv_row_counts.push_back(RowCount(peer_idx, rank));
  }
  return plan;
}

}  // namespace

void CheckAllToAllV(Communicator& comm, at::ScalarType dtype,
                    const std::vector<int64_t>& trailing_shape) {
  const int num_ranks = comm.size();
  const int rank = comm.rank();
  const std::string what = absl::StrCat("AllToAllV of ", c10::toString(dtype), " rows ",
                                        ShapeText(trailing_shape), " on rank ", rank);

  // The dispatch pattern: exchange counts first, then size recv from them.
  const AllToAllPlan plan = AllToAllPlanOf(comm);
  const at::Tensor send_counts = at::tensor(plan.send_row_counts, at::kLong);
  const at::Tensor recv_counts = at::empty({num_ranks}, On(comm, at::kLong));
  ExpectOk(comm.AllToAllCounts(send_counts.to(comm.device()), recv_counts), what + " (counts)");
  const at::Tensor recv_counts_cpu = recv_counts.cpu();
  const std::vector<int64_t> recv_row_counts(recv_counts_cpu.data_ptr<int64_t>(),
                                             recv_counts_cpu.data_ptr<int64_t>() + num_ranks);
  EXPECT_EQ(recv_row_counts, plan.recv_row_counts) << what;

  const at::Tensor send = MakeRows(plan.send_blocks, trailing_shape, dtype, comm.device());
  const at::Tensor expected =
      MakeRows(plan.expected_blocks, trailing_shape, dtype, c10::Device(c10::kCPU));
  // Filled with a value no row carries, so unwritten rows show.
  const at::Tensor recv = at::full(expected.sizes(), 255, On(comm, dtype));
  ExpectOk(comm.AllToAllV(send, plan.send_row_counts, recv, plan.recv_row_counts), what);
  ExpectSameTensor(recv, expected, what);
}

void CheckAllToAllVGather(Communicator& comm, at::ScalarType dtype,
                          const std::vector<int64_t>& trailing_shape) {
  const std::string what = absl::StrCat("AllToAllVGather of ", c10::toString(dtype), " rows ",
                                        ShapeText(trailing_shape), " on rank ", comm.rank());
  const AllToAllPlan plan = AllToAllPlanOf(comm);
  const at::Tensor send = MakeRows(plan.send_blocks, trailing_shape, dtype, comm.device());
  const int64_t n = send.size(0);
  // The source: the rows to send reversed, twice over; row i to send is
  // picked from the first copy for even i and from the second for odd i.
  const at::Tensor src = at::cat({send.flip({0}), send.flip({0})});
  at::Tensor send_rows = at::empty({n}, at::kLong);
  for (int64_t i = 0; i < n; ++i) send_rows[i] = (n - 1 - i) + (i % 2) * n;
  const at::Tensor expected =
      MakeRows(plan.expected_blocks, trailing_shape, dtype, c10::Device(c10::kCPU));
  const at::Tensor recv = at::full(expected.sizes(), 255, On(comm, dtype));
  ExpectOk(comm.AllToAllVGather(src, send_rows, plan.send_row_counts, recv, plan.recv_row_counts),
           what);
  ExpectSameTensor(recv, expected, what);
  // Each peer's rows one run of consecutive rows of the source, the runs in
  // reverse rank order with a row of another value before each: the
  // backends send such runs where they lie (MPI and NCCL), at their own
  // offsets; the same rows arrive.
  {
    std::vector<at::Tensor> parts;
    std::vector<at::Tensor> picks(comm.size());
    std::vector<int64_t> trailing_one = {1};
    trailing_one.insert(trailing_one.end(), trailing_shape.begin(), trailing_shape.end());
    int64_t next_row = 0;
    for (int peer_idx = comm.size() - 1; peer_idx >= 0; --peer_idx) {
      const int64_t begin = std::accumulate(plan.send_row_counts.begin(),
                                            plan.send_row_counts.begin() + peer_idx, int64_t{0});
      const int64_t count = plan.send_row_counts[peer_idx];
      parts.push_back(at::full(trailing_one, 254, On(comm, dtype)));
      parts.push_back(send.narrow(0, begin, count));
      picks[peer_idx] = at::arange(next_row + 1, next_row + 1 + count, at::kLong);
      next_row += 1 + count;
    }
    const at::Tensor runs = at::cat(parts);
    const at::Tensor in_runs = at::full(expected.sizes(), 255, On(comm, dtype));
    ExpectOk(comm.AllToAllVGather(runs, at::cat(picks), plan.send_row_counts, in_runs,
                                  plan.recv_row_counts),
             what + " (each peer's rows one run)");
    ExpectSameTensor(in_runs, expected, what + " (each peer's rows one run)");
  }
  // A pick outside the source fails on this rank before anything is posted.
  if (n > 0) {
    at::Tensor outside = send_rows.clone();
    outside[0] = src.size(0);
    EXPECT_THROW(
        comm.AllToAllVGather(src, outside, plan.send_row_counts, recv, plan.recv_row_counts),
        c10::Error)
        << what;
  }
}

void CheckAllReduce(Communicator& comm, at::ScalarType dtype, ReduceOp op) {
  const int num_ranks = comm.size();
  const int rank = comm.rank();
  // Rank r holds (r + 1) * base(i), base(i) = i % 7 + 1, over 15 elements.
  const at::Tensor base = (at::arange(15, at::kLong).remainder(7) + 1).reshape({3, 5});
  const at::Tensor tensor = (base * (rank + 1)).to(dtype).to(comm.device());
  at::Tensor expected;
  switch (op) {
    case ReduceOp::kSum:
      expected = base * (num_ranks * (num_ranks + 1) / 2);
      break;
    case ReduceOp::kMax:
      expected = base * num_ranks;
      break;
    case ReduceOp::kMin:
      expected = base;
      break;
  }
  const std::string what = absl::StrCat("AllReduce(", ReduceOpName(op), ") of ",
                                        c10::toString(dtype), " on rank ", rank);
  ExpectOk(comm.AllReduce(tensor, op), what);
  ExpectSameTensor(tensor, expected.to(dtype), what);
}

void CheckAllGather(Communicator& comm, at::ScalarType dtype,
                    const std::vector<int64_t>& trailing_shape) {
  const int rank = comm.rank();
  std::vector<RowBlock> expected_blocks;
  for (int peer_idx = 0; peer_idx < comm.size(); ++peer_idx)
    expected_blocks.push_back({peer_idx, 0, 2});
  const at::Tensor send = MakeRows({{rank, 0, 2}}, trailing_shape, dtype, comm.device());
  const at::Tensor expected =
      MakeRows(expected_blocks, trailing_shape, dtype, c10::Device(c10::kCPU));
  const at::Tensor recv = at::full(expected.sizes(), 255, On(comm, dtype));
  const std::string what = absl::StrCat("AllGather of ", c10::toString(dtype), " rows ",
                                        ShapeText(trailing_shape), " on rank ", rank);
  ExpectOk(comm.AllGather(send, recv), what);
  ExpectSameTensor(recv, expected, what);
}

void CheckAllGatherV(Communicator& comm, at::ScalarType dtype,
                     const std::vector<int64_t>& trailing_shape) {
  const int rank = comm.rank();
  // Rank p contributes p % 3 rows: rank 0 (and 3) nothing.
  std::vector<RowBlock> expected_blocks;
  std::vector<int64_t> recv_row_counts;
  for (int peer_idx = 0; peer_idx < comm.size(); ++peer_idx) {
    expected_blocks.push_back({peer_idx, 1, peer_idx % 3});
    recv_row_counts.push_back(peer_idx % 3);
  }
  const at::Tensor send = MakeRows({{rank, 1, rank % 3}}, trailing_shape, dtype, comm.device());
  const at::Tensor expected =
      MakeRows(expected_blocks, trailing_shape, dtype, c10::Device(c10::kCPU));
  const at::Tensor recv = at::full(expected.sizes(), 255, On(comm, dtype));
  const std::string what = absl::StrCat("AllGatherV of ", c10::toString(dtype), " rows ",
                                        ShapeText(trailing_shape), " on rank ", rank);
  ExpectOk(comm.AllGatherV(send, recv, recv_row_counts), what);
  ExpectSameTensor(recv, expected, what);
}

void CheckBroadcast(Communicator& comm, at::ScalarType dtype, int root_rank) {
  const int rank = comm.rank();
  const std::vector<int64_t> trailing_shape = {5};
  const at::Tensor expected =
      MakeRows({{root_rank, 2, 3}}, trailing_shape, dtype, c10::Device(c10::kCPU));
  const at::Tensor tensor =
      rank == root_rank ? expected.to(comm.device()) : at::full({3, 5}, 255, On(comm, dtype));
  const std::string what = absl::StrCat("Broadcast of ", c10::toString(dtype), " from rank ",
                                        root_rank, " on rank ", rank);
  ExpectOk(comm.Broadcast(tensor, root_rank), what);
  ExpectSameTensor(tensor, expected, what);
}

void CheckBarrier(Communicator& comm) {
  ExpectOk(comm.Barrier(), absl::StrCat("Barrier on rank ", comm.rank()));
}

void CheckOverlappingWork(Communicator& comm) {
  const int num_ranks = comm.size();
  const int rank = comm.rank();
  const at::Tensor sum = at::full({8}, rank + 1, On(comm, at::kFloat));
  const at::Tensor send = at::full({1}, rank, On(comm, at::kLong));
  const at::Tensor gathered = at::full({num_ranks}, -1, On(comm, at::kLong));
  const std::shared_ptr<Work> first = comm.AllReduce(sum, ReduceOp::kSum);
  const std::shared_ptr<Work> second = comm.AllGather(send, gathered);
  ExpectOk(second, "second of two overlapping collectives");
  ExpectOk(first, "first of two overlapping collectives");
  ExpectSameTensor(sum, at::full({8}, num_ranks * (num_ranks + 1) / 2, at::kFloat),
                   "overlapping AllReduce");
  ExpectSameTensor(gathered, at::arange(num_ranks, at::kLong), "overlapping AllGather");
}

void CheckSplit(Communicator& comm) {
  const int num_ranks = comm.size();
  const int rank = comm.rank();
  // Ranks of equal parity, keyed by -rank: each group in descending rank order.
  absl::StatusOr<std::shared_ptr<Communicator>> parity = comm.Split(rank % 2, -rank, "parity");
  ASSERT_TRUE(parity.ok()) << parity.status();  // a Split failure is the same on every rank
  ASSERT_NE(*parity, nullptr);
  const Communicator& group = **parity;
  std::vector<int64_t> members;
  for (int member = num_ranks - 1; member >= 0; --member) {
    if (member % 2 == rank % 2) members.push_back(member);
  }
  EXPECT_EQ(group.size(), static_cast<int>(members.size()));
  EXPECT_EQ(group.name(), "parity");
  EXPECT_EQ(group.BackendName(), comm.BackendName());
  int expected_rank = -1;
  for (size_t member_idx = 0; member_idx < members.size(); ++member_idx) {
    if (members[member_idx] == rank) expected_rank = static_cast<int>(member_idx);
  }
  EXPECT_EQ(group.rank(), expected_rank);
  const at::Tensor gathered = at::full({group.size()}, -1, On(comm, at::kLong));
  ExpectOk((*parity)->AllGather(at::full({1}, rank, On(comm, at::kLong)), gathered),
           "AllGather over a split");
  ExpectSameTensor(gathered, at::tensor(members, at::kLong),
                   "members of the parity group, in key order");

  // Rank 0 joins no group; the others form one.
  absl::StatusOr<std::shared_ptr<Communicator>> without_zero =
      comm.Split(rank == 0 ? -1 : 0, rank, /*name=*/"");
  ASSERT_TRUE(without_zero.ok()) << without_zero.status();
  if (rank == 0) {
    EXPECT_EQ(*without_zero, nullptr);
  } else {
    ASSERT_NE(*without_zero, nullptr);
    EXPECT_EQ((*without_zero)->size(), num_ranks - 1);
    EXPECT_EQ((*without_zero)->rank(), rank - 1);
    EXPECT_EQ((*without_zero)->name(), comm.name() + "/0");
    const at::Tensor total = at::full({1}, rank, On(comm, at::kLong));
    ExpectOk((*without_zero)->AllReduce(total, ReduceOp::kSum),
             "AllReduce over a split without rank 0");
    ExpectSameTensor(total, at::full({1}, num_ranks * (num_ranks - 1) / 2, at::kLong),
                     "sum of ranks 1..n-1");
  }
}

}  // namespace moefit::parallel::testing
