// The dispatchers' row moves (GroupOf, Collect) against the same moves written
// with LibTorch's index_select and index_add, forward and backward, in
// float64, float32 and bfloat16, with groups of every size up to f (none
// included) and more rows than one parallel block; SumAroundBlock against
// Collect.
#include "experts/kernels/row_ops.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <string>
#include <utility>
#include <vector>

namespace moefit::experts::kernels {
namespace {

struct Case {
  RowRelation rel;
  at::Tensor group;  // [M]: each member's group, from where it was placed
};

// `members` rows spread at random over the P x f slots.
Case RandomRelation(int64_t groups, int64_t f, int64_t members, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor table = at::full({groups * f}, -1, at::kLong);
  at::Tensor where = at::randperm(groups * f, gen, at::kLong).narrow(0, 0, members);
  table.index_put_({where}, at::arange(members, at::kLong));
  Case c;
  c.rel = MakeRowRelation(table.view({groups, f}), members);
  c.group = at::div(where, f, "floor");
  return c;
}

TEST(RowOps, MakeRowRelationInvertsMembers) {
  RowRelation r = MakeRowRelation(at::tensor({2, -1, 0, 1}, at::kLong).view({2, 2}), 3);
  EXPECT_TRUE(at::equal(r.slot, at::tensor({2, 3, 0}, at::kLong)));
}

TEST(RowOps, MakeRowRelationRejectsBadTables) {
  auto table = [](std::vector<int64_t> v) { return at::tensor(v, at::kLong).view({2, 2}); };
  EXPECT_THROW(MakeRowRelation(table({0, 0, 1, -1}), 2), c10::Error);   // member in two groups
  EXPECT_THROW(MakeRowRelation(table({0, 3, 1, -1}), 3), c10::Error);   // outside [0, 3)
  EXPECT_THROW(MakeRowRelation(table({0, -1, 1, -1}), 3), c10::Error);  // member 2 in no group
}

// Gradients of src and of the weights (and of src alone without weights)
// against the same chain in LibTorch ops, at width h.
void CheckGradients(at::ScalarType dtype, int64_t h) {
  const int64_t groups = 200, f = 3, members = 400;
  Case c = RandomRelation(groups, f, members, 3);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(4);
  const at::ScalarType acc = dtype == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor src0 = at::randn({groups, h}, gen, at::kDouble).to(dtype);
  at::Tensor w0 = at::rand({groups, f}, gen, at::kDouble).to(acc);
  at::Tensor up = at::randn({groups, h}, gen, at::kDouble).to(acc);

  // src -> each member's group row -> x 1.5 -> Collect (with weights or
  // without), against the same chain in LibTorch ops.
  auto run = [&](bool ours, bool weighted) {
    at::Tensor src = src0.clone().requires_grad_(true);
    at::Tensor w = w0.clone().requires_grad_(true);
    at::Tensor out;
    if (ours) {
      out = Collect(src.index_select(0, GroupOf(c.rel)) * 1.5, c.rel, weighted ? w : at::Tensor());
    } else {
      at::Tensor spread = src.index_select(0, c.group) * 1.5;
      at::Tensor mw = w.reshape({-1}).index_select(0, c.rel.slot);
      out =
          at::zeros({groups, h}, spread.options().dtype(acc))
              .index_add(0, c.group, weighted ? spread.to(acc) * mw.unsqueeze(1) : spread.to(acc));
    }
    if (!weighted) return std::make_pair(torch::autograd::grad({(out * up).sum()}, {src})[0], w);
    auto g = torch::autograd::grad({(out * up).sum()}, {src, w});
    return std::make_pair(g[0], g[1]);
  };
  const double tol = dtype == at::kDouble ? 1e-12 : dtype == at::kFloat ? 1e-4 : 2e-2;
  auto expect_close = [&](const at::Tensor& got, const at::Tensor& want) {
    EXPECT_TRUE(at::allclose(got.to(at::kDouble), want.to(at::kDouble), tol, tol))
        << (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  };
  auto [ds, dw] = run(true, true);
  auto [ds_ref, dw_ref] = run(false, true);
  EXPECT_EQ(ds.scalar_type(), dtype);
  expect_close(ds, ds_ref);
  expect_close(dw, dw_ref);
  // No member: no weight gradient.
  EXPECT_EQ(dw.index({c.rel.members.lt(0)}).abs().sum().item<double>(), 0.0);
  auto [plain, unused] = run(true, false);
  auto [plain_ref, unused_ref] = run(false, false);
  EXPECT_EQ(plain.scalar_type(), dtype);
  expect_close(plain, plain_ref);
}

class RowOpsTest : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(RowOpsTest, GroupOfAndCollectMatchIndexSelectAndIndexAdd) {
  const at::ScalarType dtype = GetParam();
  const int64_t groups = 300, f = 4, members = 700, h = 37;
  Case c = RandomRelation(groups, f, members, 1);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(2);
  at::Tensor src = at::randn({groups, h}, gen, at::kDouble).to(dtype);
  at::Tensor rows = at::randn({members, h}, gen, at::kDouble).to(dtype);
  at::Tensor weight =
      at::rand({groups, f}, gen, at::kDouble).to(dtype == at::kDouble ? at::kDouble : at::kFloat);
  const at::ScalarType acc = dtype == at::kDouble ? at::kDouble : at::kFloat;

  EXPECT_TRUE(at::equal(GroupOf(c.rel), c.group));

  const double tol = dtype == at::kDouble ? 1e-13 : 1e-5;
  at::Tensor member_weight = weight.reshape({-1}).index_select(0, c.rel.slot);
  at::Tensor want = at::zeros({groups, h}, rows.options().dtype(acc))
                        .index_add(0, c.group, rows.to(acc) * member_weight.to(acc).unsqueeze(1));
  at::Tensor got = Collect(rows, c.rel, weight);
  EXPECT_EQ(got.scalar_type(), acc);
  EXPECT_TRUE(at::allclose(got, want, tol, tol)) << (got - want).abs().max().item<double>();
  at::Tensor plain =
      at::zeros({groups, h}, rows.options().dtype(acc)).index_add(0, c.group, rows.to(acc));
  EXPECT_TRUE(at::allclose(Collect(rows, c.rel), plain, tol, tol));
  // Groups without members get zeros.
  at::Tensor empty = c.rel.members.ge(0).sum(1).eq(0);
  ASSERT_GT(empty.sum().item<int64_t>(), 0);
  EXPECT_EQ(got.index({empty}).abs().sum().item<double>(), 0.0);
}

// The rows with a block inserted, at the start, in the middle and at the
// end, and an empty block: the same sums, bit for bit, as Collect of the
// rows put together.
TEST_P(RowOpsTest, SumAroundBlockEqualsCollectOfTheRowsTogether) {
  const at::ScalarType dtype = GetParam();
  const int64_t groups = 300, f = 4, members = 700, h = 45;
  Case c = RandomRelation(groups, f, members, 3);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(4);
  const at::Tensor rows = at::randn({members, h}, gen, at::kDouble).to(dtype);
  const at::Tensor want = Collect(rows, c.rel);
  for (const auto& [block_at, block_rows] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 120}, {250, 333}, {580, 120}, {400, 0}}) {
    SCOPED_TRACE("block of " + std::to_string(block_rows) + " at " + std::to_string(block_at));
    const at::Tensor block = rows.narrow(0, block_at, block_rows).clone();
    const at::Tensor around =
        at::cat({rows.narrow(0, 0, block_at),
                 rows.narrow(0, block_at + block_rows, members - block_at - block_rows)});
    const at::Tensor got = SumAroundBlock(around, block_at, block, c.rel);
    EXPECT_EQ(got.scalar_type(), want.scalar_type());
    EXPECT_TRUE(at::equal(got, want));
  }
  // Rows that do not add up to the members, or a block of another width.
  EXPECT_THROW(SumAroundBlock(rows.narrow(0, 0, 600), 0, rows.narrow(0, 0, 99), c.rel), c10::Error);
  EXPECT_THROW(
      SumAroundBlock(rows.narrow(0, 0, 600), 0, at::zeros({100, h + 1}, rows.options()), c.rel),
      c10::Error);
}

// Widths below one block of the backward (64 values), and above it with a
// tail, where float32 rows alternate between 16-byte aligned and not; the
// gradient rows stored as usual (these are far smaller than a cache) and
// streamed past the cache.
TEST_P(RowOpsTest, GradientsMatchIndexSelectAndIndexAdd) {
  const int64_t by_default = SetStreamAboveBytes(0);
  for (const bool streamed : {false, true}) {
    SetStreamAboveBytes(streamed ? 0 : int64_t{1} << 40);
    for (const int64_t h : {19, 70, 133}) {
      SCOPED_TRACE("h " + std::to_string(h) + (streamed ? ", streamed" : ""));
      CheckGradients(GetParam(), h);
    }
  }
  SetStreamAboveBytes(by_default);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, RowOpsTest,
                         ::testing::Values(at::kDouble, at::kFloat, at::kBFloat16));

}  // namespace
}  // namespace moefit::experts::kernels
