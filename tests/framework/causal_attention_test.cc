// The CPU causal attention kernel (framework/causal_attention.h) against
// attention written out in float64 (scores, causal mask, softmax, values)
// and against SDPA in float32, forward and the three gradients: GQA and plain
// heads, sequences shorter than a query block, not a multiple of it, and
// longer than a key block (the online softmax's rescaling), strided inputs,
// value heads narrower than the keys'; on every instruction set this CPU
// runs; packed rows' segments; with the same bits at one and two threads.
#include "framework/causal_attention.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <limits>
#include <tuple>
#include <vector>

#include "experts/kernels/isa.h"
#include "tests/framework/kernel_checks.h"

namespace moefit::framework {
namespace {

namespace kern = moefit::experts::kernels;

struct Shape {
  int64_t batch, heads, kv_heads, t, d_qk, d_v;
};

struct Inputs {
  at::Tensor q, k, v, grad_out;
};

// q laid out [B, T, H, d] and viewed [B, H, T, d] (as the model's
// projections make it), k and v contiguous [B, Hkv, T, d].
Inputs MakeInputs(const Shape& s, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Inputs in;
  in.q = at::randn({s.batch, s.t, s.heads, s.d_qk}, gen, at::kFloat).transpose(1, 2);
  in.k = at::randn({s.batch, s.kv_heads, s.t, s.d_qk}, gen, at::kFloat);
  in.v = at::randn({s.batch, s.kv_heads, s.t, s.d_v}, gen, at::kFloat);
  in.grad_out = at::randn({s.batch, s.heads, s.t, s.d_v}, gen, at::kFloat);
  return in;
}

struct Result {
  at::Tensor out, dq, dk, dv;
};

// Output and gradients of `attend` for `in` in `dtype`.
template <typename F>
Result RunAttention(const Inputs& in, at::ScalarType dtype, F attend) {
  const at::Tensor q = in.q.to(dtype).clone().requires_grad_(true);
  const at::Tensor k = in.k.to(dtype).clone().requires_grad_(true);
  const at::Tensor v = in.v.to(dtype).clone().requires_grad_(true);
  at::Tensor out = attend(q, k, v);
  out.backward(in.grad_out.to(dtype));
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

at::Tensor RepeatHeads(const at::Tensor& x, int64_t groups) {
  return groups == 1 ? x : x.repeat_interleave(groups, 1);
}

// [B, 1, T, T] true where query i may see key j: j <= i, and in the same
// segment where segment_ids is defined.
at::Tensor Allowed(int64_t t, const at::Tensor& segment_ids) {
  at::Tensor allowed = at::ones({t, t}, at::kBool).tril().view({1, 1, t, t});
  if (!segment_ids.defined()) return allowed;
  const at::Tensor same = segment_ids.unsqueeze(2).eq(segment_ids.unsqueeze(1)).unsqueeze(1);
  return allowed.logical_and(same);
}

// Attention written out: scores, the mask, softmax, values.
at::Tensor Reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                     const at::Tensor& segment_ids = {}) {
  const int64_t groups = q.size(1) / k.size(1);
  at::Tensor scores = at::matmul(q, RepeatHeads(k, groups).transpose(-2, -1)) * scale;
  scores = scores.masked_fill(Allowed(q.size(2), segment_ids).logical_not(),
                              -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(scores, -1), RepeatHeads(v, groups));
}

at::Tensor Sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                const at::Tensor& segment_ids = {}) {
  const int64_t groups = q.size(1) / k.size(1);
  const at::Tensor kr = RepeatHeads(k, groups), vr = RepeatHeads(v, groups);
  if (segment_ids.defined()) {
    return at::scaled_dot_product_attention(q, kr, vr, Allowed(q.size(2), segment_ids), 0.0,
                                            /*is_causal=*/false, scale);
  }
  return at::scaled_dot_product_attention(q, kr, vr, {}, 0.0, /*is_causal=*/true, scale);
}

// RelativeError is absolute for small values: with one token every gradient
// but dv is 0, up to rounding (softmax over one key does not depend on its
// score).
void ExpectClose(const Result& got, const Result& want, double tol, const std::string& what) {
  EXPECT_LT(RelativeError(got.out, want.out), tol) << what << ": output";
  EXPECT_LT(RelativeError(got.dq, want.dq), tol) << what << ": dq";
  EXPECT_LT(RelativeError(got.dk, want.dk), tol) << what << ": dk";
  EXPECT_LT(RelativeError(got.dv, want.dv), tol) << what << ": dv";
}

// CausalAttention on every instruction set this CPU runs (narrower ones held
// down with LimitIsa) within 2e-5 of the float64 reference and of SDPA.
void ExpectEveryIsaClose(const Inputs& in, double scale, const at::Tensor& segment_starts,
                         const Result& want, const Result& sdpa) {
  const FullIsaAfter restore;
  for (int i = static_cast<int>(kern::DetectIsa()); i >= 0; --i) {
    const kern::Isa isa = static_cast<kern::Isa>(i);
    kern::LimitIsa(isa);
    const Result got = RunAttention(in, at::kFloat, [&](auto q, auto k, auto v) {
      return CausalAttention(q, k, v, scale, segment_starts);
    });
    ExpectClose(got, want, 2e-5, std::string(kern::IsaName(isa)) + " vs float64");
    ExpectClose(got, sdpa, 2e-5, std::string(kern::IsaName(isa)) + " vs SDPA");
  }
}

class CausalAttentionShapes : public ::testing::TestWithParam<Shape> {};

TEST_P(CausalAttentionShapes, MatchesFloat64AndSdpaOnEveryInstructionSet) {
  const Shape s = GetParam();
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.d_qk));
  const Inputs in = MakeInputs(s, 11);
  const Result want = RunAttention(
      in, at::kDouble, [&](auto q, auto k, auto v) { return Reference(q, k, v, scale); });
  const Result sdpa =
      RunAttention(in, at::kFloat, [&](auto q, auto k, auto v) { return Sdpa(q, k, v, scale); });
  ASSERT_TRUE(CausalAttentionApplies(in.q, in.k, in.v));
  // SDPA itself is this far from float64: the kernel must be as close.
  ExpectClose(sdpa, want, 2e-5, "SDPA");
  ExpectEveryIsaClose(in, scale, /*segment_starts=*/{}, want, sdpa);
}

INSTANTIATE_TEST_SUITE_P(
    All, CausalAttentionShapes,
    ::testing::Values(Shape{1, 2, 2, 1, 8, 8},      // one token
                      Shape{2, 4, 2, 19, 16, 16},   // GQA, under one query block
                      Shape{2, 4, 1, 67, 24, 20},   // not a multiple of the block, d_v < d_qk
                      Shape{1, 3, 3, 300, 16, 12},  // past one key block (rescaling)
                      Shape{1, 2, 1, 600, 8, 8}));  // several key blocks

// Packed rows: segments that start inside query blocks and key blocks, one
// longer than a key block, single-token segments (padding), on every
// instruction set, against float64 and SDPA with the explicit mask.
TEST(CausalAttention, SegmentsMatchFloat64AndSdpaWithTheirMask) {
  const Shape s{2, 4, 2, 300, 16, 16};
  const Inputs in = MakeInputs(s, 13);
  // Row 0: segments starting at 0, 37, 38, 270; row 1: 0, 5, 6, 7, 100.
  std::vector<int64_t> ids(2 * s.t);
  for (int64_t t = 0; t < s.t; ++t) {
    ids[t] = (t >= 37) + (t >= 38) + (t >= 270);
    ids[s.t + t] = (t >= 5) + (t >= 6) + (t >= 7) + (t >= 100);
  }
  const at::Tensor segment_ids = at::tensor(ids, at::kLong).view({2, s.t});
  const at::Tensor starts = SegmentStarts(segment_ids);
  EXPECT_EQ(starts[0][36].item<int64_t>(), 0);
  EXPECT_EQ(starts[0][37].item<int64_t>(), 37);
  EXPECT_EQ(starts[0][299].item<int64_t>(), 270);
  EXPECT_EQ(starts[1][6].item<int64_t>(), 6);
  EXPECT_EQ(starts[1][99].item<int64_t>(), 7);
  const double scale = 0.25;
  const Result want = RunAttention(in, at::kDouble, [&](auto q, auto k, auto v) {
    return Reference(q, k, v, scale, segment_ids);
  });
  const Result sdpa = RunAttention(
      in, at::kFloat, [&](auto q, auto k, auto v) { return Sdpa(q, k, v, scale, segment_ids); });
  ExpectClose(sdpa, want, 2e-5, "SDPA");
  ExpectEveryIsaClose(in, scale, starts, want, sdpa);
}

TEST(CausalAttention, SameBitsAtOneAndTwoThreads) {
  const Shape s{2, 4, 2, 150, 32, 32};
  const Inputs in = MakeInputs(s, 3);
  auto run = [&](int threads) {
    return AtThreads(threads, [&] {
      return RunAttention(in, at::kFloat,
                          [&](auto q, auto k, auto v) { return CausalAttention(q, k, v, 0.125); });
    });
  };
  const Result one = run(1), two = run(2);
  EXPECT_TRUE(at::equal(one.out, two.out));
  EXPECT_TRUE(at::equal(one.dq, two.dq));
  EXPECT_TRUE(at::equal(one.dk, two.dk));
  EXPECT_TRUE(at::equal(one.dv, two.dv));
}

// Data parallelism splits a batch over ranks: each sequence's output and
// gradients must be the same bits whatever else shares its batch.
TEST(CausalAttention, EachSequenceGivesTheSameBitsInAnyBatch) {
  const Shape s{4, 4, 2, 150, 32, 32};
  const Inputs in = MakeInputs(s, 9);
  auto half = [&](int64_t from) {
    Inputs part;
    part.q = in.q.narrow(0, from, 2);
    part.k = in.k.narrow(0, from, 2);
    part.v = in.v.narrow(0, from, 2);
    part.grad_out = in.grad_out.narrow(0, from, 2);
    return RunAttention(part, at::kFloat,
                        [&](auto q, auto k, auto v) { return CausalAttention(q, k, v, 0.125); });
  };
  const Result all = RunAttention(
      in, at::kFloat, [&](auto q, auto k, auto v) { return CausalAttention(q, k, v, 0.125); });
  for (int64_t from : {0, 2}) {
    const Result part = half(from);
    EXPECT_TRUE(at::equal(part.out, all.out.narrow(0, from, 2))) << from;
    EXPECT_TRUE(at::equal(part.dq, all.dq.narrow(0, from, 2))) << from;
    EXPECT_TRUE(at::equal(part.dk, all.dk.narrow(0, from, 2))) << from;
    EXPECT_TRUE(at::equal(part.dv, all.dv.narrow(0, from, 2))) << from;
  }
}

TEST(CausalAttention, OutputIsLaidOutTokenMajor) {
  const Inputs in = MakeInputs({1, 2, 2, 5, 4, 4}, 5);
  const at::Tensor out = CausalAttention(in.q, in.k, in.v, 0.5);
  EXPECT_TRUE(out.transpose(1, 2).is_contiguous());
}

TEST(CausalAttention, RefusesWhatItDoesNotCompute) {
  const Inputs in = MakeInputs({1, 4, 2, 6, 4, 4}, 7);
  EXPECT_FALSE(CausalAttentionApplies(in.q.to(at::kDouble), in.k, in.v));
  EXPECT_FALSE(CausalAttentionApplies(in.q, in.k.narrow(2, 0, 5), in.v));  // cross-attention
  EXPECT_FALSE(CausalAttentionApplies(in.q.narrow(1, 0, 3), in.k, in.v));  // 3 heads over 2
  EXPECT_THROW(CausalAttention(in.q, in.k.narrow(2, 0, 5), in.v, 0.5), c10::Error);
  // A segment start after its token.
  const at::Tensor bad = at::tensor({0, 0, 3, 3, 3, 3}, at::kLong).view({1, 6});
  EXPECT_THROW(CausalAttention(in.q, in.k, in.v, 0.5, bad), c10::Error);
}

}  // namespace
}  // namespace moefit::framework
