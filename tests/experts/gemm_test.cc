// moefit's expert GEMM on every instruction set this CPU can run, against a
// float64 reference over the exact float32 values of its operands: every
// element type and layout the expert layer uses, odd shapes, accumulation,
// both output types. int4 weights, whose elements are bfloat16 values, also
// against their bfloat16 dequantization, bit for bit.
#include "experts/kernels/gemm.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "experts/kernels/internal/bf16_pairs.h"
#include "experts/kernels/internal/fp8_tables.h"
#include "experts/kernels/isa.h"

namespace moefit::experts::kernels {
namespace {

// Storage for one operand: a [rows, cols] matrix stored row-major or
// transposed, in `type`, with FP8 block scales, or int4 group scales and
// zero points.
struct Stored {
  at::Tensor data, scales, zeros;
  Operand op;
  int64_t stored_cols = 0;  // int4: the stored matrix's logical columns
};

at::ScalarType TorchType(ElemType t) {
  switch (t) {
    case ElemType::kF32:
      return at::kFloat;
    case ElemType::kBF16:
      return at::kBFloat16;
    case ElemType::kF8E4M3:
      return at::kFloat8_e4m3fn;
    case ElemType::kI4:
      return at::kByte;
  }
  return at::kFloat;
}

// How an int4 operand is grouped: consecutive elements of a stored row per
// scale, and whether it has zero points (an asymmetric scheme).
struct Int4Groups {
  int64_t size = 32;
  bool zero_points = false;
};

// An int4 weight W [r, c] as compressed-tensors stores one: each row's c
// nibbles (random, every value) packed little end first into
// ceil(c / 8) int32 words (their bytes here), a bfloat16 scale per group of
// `groups.size` columns of a row (the last group may be partial), and int8
// zero points in [-8, 7] when asymmetric. transposed: read as Wᵀ.
Stored MakeInt4Operand(int64_t rows, int64_t cols, bool transposed, Int4Groups groups,
                       uint64_t seed) {
  at::manual_seed(seed);
  const int64_t r = transposed ? cols : rows, c = transposed ? rows : cols;
  const int64_t padded = (c + 7) / 8 * 8, num_groups = (c + groups.size - 1) / groups.size;
  Stored s;
  at::Tensor nibbles = at::randint(16, {r, padded}, at::kByte);
  nibbles.narrow(1, c, padded - c).zero_();
  s.data = nibbles.slice(1, 0, padded, 2)
               .bitwise_or(nibbles.slice(1, 1, padded, 2).bitwise_left_shift(4))
               .contiguous();
  s.scales = (at::rand({r, num_groups}).add_(0.5).div_(64)).to(at::kBFloat16).contiguous();
  if (groups.zero_points) s.zeros = at::randint(-8, 8, {r, num_groups}, at::kChar);
  s.stored_cols = c;
  s.op.data = s.data.data_ptr();
  s.op.type = ElemType::kI4;
  s.op.row_stride = transposed ? 1 : padded;
  s.op.col_stride = transposed ? padded : 1;
  s.op.group_scales = reinterpret_cast<const uint16_t*>(s.scales.data_ptr());
  s.op.zero_points = groups.zero_points ? s.zeros.data_ptr<int8_t>() : nullptr;
  s.op.group_rows = transposed ? groups.size : 1;
  s.op.group_cols = transposed ? 1 : groups.size;
  s.op.scale_row_stride = transposed ? 1 : num_groups;
  s.op.scale_col_stride = transposed ? num_groups : 1;
  return s;
}

// transposed: element (i, j) lives at [j, i] of a [cols, rows] tensor, as a
// packed weight [N, K] is read as B = Wᵀ.
Stored MakeOperand(int64_t rows, int64_t cols, ElemType type, bool transposed, uint64_t seed) {
  if (type == ElemType::kI4) return MakeInt4Operand(rows, cols, transposed, {}, seed);
  at::manual_seed(seed);
  Stored s;
  at::Tensor values = transposed ? at::randn({cols, rows}) : at::randn({rows, cols});
  if (type == ElemType::kF8E4M3) values = values * 100;  // use e4m3's range
  s.data = values.to(TorchType(type)).contiguous();
  const int64_t ld = s.data.size(1);
  s.op.data = s.data.data_ptr();
  s.op.type = type;
  s.op.row_stride = transposed ? 1 : ld;
  s.op.col_stride = transposed ? ld : 1;
  if (type == ElemType::kF8E4M3) {
    const int64_t br = (s.data.size(0) + kScaleBlock - 1) / kScaleBlock;
    const int64_t bc = (s.data.size(1) + kScaleBlock - 1) / kScaleBlock;
    s.scales = at::rand({br, bc}).add_(0.5).div_(100).contiguous();
    s.op.scales = s.scales.data_ptr<float>();
    s.op.scale_row_stride = transposed ? 1 : bc;
    s.op.scale_col_stride = transposed ? bc : 1;
  }
  return s;
}

// An FP8 operand's bfloat16 dequantization (FP8 x block scale rounded once),
// laid out as the FP8 one: `values` holds it, `op` reads it.
struct Dequantized {
  at::Tensor values;
  Operand op;
};

// An int4 operand's, the way compressed-tensors decompresses it: the nibbles
// unpacked, less 8 and the zero point, times the scale in bfloat16.
Dequantized Int4Bf16Dequantization(const Stored& w) {
  const int64_t r = w.data.size(0), c = w.stored_cols;
  const int64_t group = w.op.group_rows * w.op.group_cols;  // one of them is 1
  const at::Tensor bytes = w.data.to(at::kInt);
  const at::Tensor q = at::stack({bytes.bitwise_and(15), bytes.bitwise_right_shift(4)}, 2)
                           .reshape({r, -1})
                           .narrow(1, 0, c)
                           .sub(8);
  auto per_column = [&](const at::Tensor& t) {
    return t.repeat_interleave(group, 1).narrow(1, 0, c);
  };
  at::Tensor value = q.to(at::kBFloat16);
  if (w.zeros.defined()) value = value - per_column(w.zeros).to(at::kBFloat16);
  Dequantized d{(value * per_column(w.scales)).contiguous(), w.op};
  const bool transposed = w.op.row_stride == 1;
  d.op.type = ElemType::kBF16;
  d.op.data = d.values.data_ptr();
  d.op.row_stride = transposed ? 1 : c;
  d.op.col_stride = transposed ? c : 1;
  d.op.group_scales = nullptr;
  d.op.zero_points = nullptr;
  return d;
}

Dequantized Bf16Dequantization(const Stored& w) {
  if (w.op.type == ElemType::kI4) return Int4Bf16Dequantization(w);
  const at::Tensor full = w.scales.repeat_interleave(kScaleBlock, 0)
                              .repeat_interleave(kScaleBlock, 1)
                              .narrow(0, 0, w.data.size(0))
                              .narrow(1, 0, w.data.size(1));
  Dequantized d{(w.data.to(at::kFloat) * full).to(at::kBFloat16).contiguous(), w.op};
  d.op.type = ElemType::kBF16;
  d.op.data = d.values.data_ptr();
  d.op.scales = nullptr;
  return d;
}

struct Case {
  int64_t m, n, k;
  ElemType a_type, b_type;
  bool a_transposed, b_transposed;
  ElemType out_type;
  bool accumulate;
};

std::string Describe(Isa isa, const Case& c) {
  auto t = [](ElemType e) {
    return e == ElemType::kF32    ? "f32"
           : e == ElemType::kBF16 ? "bf16"
           : e == ElemType::kI4   ? "i4"
                                  : "f8";
  };
  return std::string(IsaName(isa)) + " m" + std::to_string(c.m) + " n" + std::to_string(c.n) +
         " k" + std::to_string(c.k) + " A " + t(c.a_type) + (c.a_transposed ? "ᵀ" : "") + " B " +
         t(c.b_type) + (c.b_transposed ? "ᵀ" : "") + " out " + t(c.out_type) +
         (c.accumulate ? " +=" : "");
}

// Runs one case and checks every element of C against the float64 sum over
// the operands' exact values, within a bound proportional to sum |a·b|:
// float32 rounding, plus, where the kernels round operands to bfloat16
// (avx512_bf16 and amx_bf16 with a narrow operand), two bfloat16 roundings per product.
void Check(Isa isa, const Case& c, uint64_t seed) {
  SCOPED_TRACE(Describe(isa, c));
  Stored a = MakeOperand(c.m, c.k, c.a_type, c.a_transposed, seed);
  Stored b = MakeOperand(c.k, c.n, c.b_type, c.b_transposed, seed + 1);
  at::Tensor prior = at::randn({c.m, c.n}).to(TorchType(c.out_type));
  at::Tensor out = prior.clone();
  Gemm(isa, c.m, c.n, c.k, a.op, b.op, Output{out.data_ptr(), c.out_type, c.n}, c.accumulate);

  const bool rounds_operands =
      MultipliesInBf16(isa) && (c.a_type != ElemType::kF32 || c.b_type != ElemType::kF32);
  // int4 elements are bfloat16 values: only A is rounded.
  const bool exact_bf16 =
      c.a_type == ElemType::kBF16 && (c.b_type == ElemType::kBF16 || c.b_type == ElemType::kI4);
  const double operand_rel = rounds_operands && !exact_bf16 ? 2.0 * std::ldexp(1.0, -8) : 0.0;
  const double out_rel = c.out_type == ElemType::kBF16 ? std::ldexp(1.0, -8) : 0.0;
  std::vector<double> av(c.m * c.k), bv(c.k * c.n);
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t k = 0; k < c.k; ++k) av[i * c.k + k] = ElementValue(a.op, i, k);
  for (int64_t k = 0; k < c.k; ++k)
    for (int64_t j = 0; j < c.n; ++j) bv[k * c.n + j] = ElementValue(b.op, k, j);
  at::Tensor prior64 = prior.to(at::kDouble), out64 = out.to(at::kDouble);
  const double* p = prior64.data_ptr<double>();
  const double* o = out64.data_ptr<double>();
  int64_t bad = 0;
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = 0; j < c.n; ++j) {
      double sum = c.accumulate ? p[i * c.n + j] : 0.0, mag = std::abs(sum);
      for (int64_t k = 0; k < c.k; ++k) {
        sum += av[i * c.k + k] * bv[k * c.n + j];
        mag += std::abs(av[i * c.k + k] * bv[k * c.n + j]);
      }
      const double tol = mag * (4e-6 * std::sqrt(static_cast<double>(c.k) + 1) + operand_rel) +
                         std::abs(sum) * out_rel + 1e-30;
      if (!(std::abs(o[i * c.n + j] - sum) <= tol) && bad++ < 3) {
        ADD_FAILURE() << "C[" << i << ", " << j << "] = " << o[i * c.n + j] << ", want " << sum
                      << " (tolerance " << tol << ")";
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

// One form of the kernels: an instruction set, and for avx512_bf16 whether
// its blocked path multiplies bfloat16 pairs or widens the weights to float32
// (both run wherever the CPU has the set, whichever this CPU would choose).
struct Form {
  Isa isa;
  std::optional<bool> bf16_pairs;
};

std::string FormName(const Form& f) {
  std::string name(IsaName(f.isa));
  if (f.bf16_pairs.has_value()) name += *f.bf16_pairs ? "_pairs" : "_widened";
  return name;
}

class GemmOnIsa : public ::testing::TestWithParam<Form> {
 protected:
  void SetUp() override {
    if (static_cast<int>(isa()) > static_cast<int>(DetectIsa())) {
      GTEST_SKIP() << IsaName(isa()) << " is not supported by this CPU (" << CpuFlags()
                   << "); its kernels run on machines that have it";
    }
    internal::SetBf16Pairs(GetParam().bf16_pairs);
  }
  void TearDown() override { internal::SetBf16Pairs(std::nullopt); }
  Isa isa() const { return GetParam().isa; }
};

// Every operand type and layout of the expert layer, at shapes that are not
// multiples of any panel or block size.
TEST_P(GemmOnIsa, MatchesFloat64ReferenceOnOddShapes) {
  const ElemType types[] = {ElemType::kF32, ElemType::kBF16, ElemType::kF8E4M3, ElemType::kI4};
  uint64_t seed = 1;
  for (ElemType bt : types) {
    for (ElemType at_ : {ElemType::kF32, ElemType::kBF16}) {
      for (bool bt_t : {false, true}) {
        for (bool at_t : {false, true}) {
          Check(isa(), {13, 37, 141, at_, bt, at_t, bt_t, ElemType::kF32, false}, seed++);
        }
      }
    }
  }
}

TEST_P(GemmOnIsa, BlockBoundariesAndTails) {
  // Beyond one k block (kb up to 512), one m block (96) and several 128-row
  // scale blocks; single rows and columns; FP8 as A too.
  const Case cases[] = {
      {1, 1, 1, ElemType::kF32, ElemType::kF32, false, true, ElemType::kF32, false},
      {1, 300, 700, ElemType::kF32, ElemType::kBF16, false, true, ElemType::kF32, false},
      {200, 5, 3, ElemType::kBF16, ElemType::kBF16, false, false, ElemType::kF32, false},
      {97, 129, 1030, ElemType::kF32, ElemType::kF8E4M3, false, true, ElemType::kF32, true},
      {130, 70, 257, ElemType::kBF16, ElemType::kF8E4M3, true, false, ElemType::kBF16, false},
      {25, 33, 513, ElemType::kF32, ElemType::kF32, true, false, ElemType::kBF16, true},
      {12, 32, 2, ElemType::kF32, ElemType::kF32, false, false, ElemType::kF32, true},
      // Whole and partial blocks of 16 rows or columns, added to C (the AMX
      // kernels run only the tiles such a block has).
      {16, 48, 100, ElemType::kF32, ElemType::kBF16, false, true, ElemType::kF32, true},
      {48, 16, 70, ElemType::kBF16, ElemType::kBF16, false, false, ElemType::kF32, true},
      {14, 40, 65, ElemType::kF32, ElemType::kF8E4M3, true, false, ElemType::kF32, true},
      // A few rows: B streamed unpacked (both B layouts, tails of k and n).
      {3, 200, 300, ElemType::kBF16, ElemType::kF8E4M3, false, false, ElemType::kBF16, true},
      {4, 70, 263, ElemType::kF32, ElemType::kF8E4M3, false, true, ElemType::kF32, false},
      {2, 129, 77, ElemType::kF32, ElemType::kBF16, false, false, ElemType::kF32, true},
      {7, 1100, 90, ElemType::kBF16, ElemType::kBF16, false, false, ElemType::kF32, false},
      {8, 45, 300, ElemType::kF32, ElemType::kF8E4M3, false, true, ElemType::kBF16, true},
      {1, 64, 129, ElemType::kBF16, ElemType::kF32, false, true, ElemType::kF32, false},
      // A bfloat16 output taller than one buffered chunk of rows (256).
      {300, 40, 70, ElemType::kBF16, ElemType::kF8E4M3, false, true, ElemType::kBF16, true},
      {520, 17, 33, ElemType::kF8E4M3, ElemType::kF32, false, false, ElemType::kBF16, false},
      // int4 weights: several k blocks, group tails, a few rows streamed.
      {97, 129, 1030, ElemType::kF32, ElemType::kI4, false, true, ElemType::kF32, true},
      {130, 70, 257, ElemType::kBF16, ElemType::kI4, false, false, ElemType::kBF16, false},
      {3, 200, 300, ElemType::kBF16, ElemType::kI4, false, false, ElemType::kBF16, true},
      {4, 70, 263, ElemType::kF32, ElemType::kI4, false, true, ElemType::kF32, false},
      {300, 40, 70, ElemType::kBF16, ElemType::kI4, false, true, ElemType::kBF16, true},
  };
  uint64_t seed = 100;
  for (const Case& c : cases) Check(isa(), c, seed++);
}

TEST_P(GemmOnIsa, EmptyReductionZeroesOrKeeps) {
  at::Tensor out = at::ones({3, 5});
  Operand dummy{out.data_ptr(), ElemType::kF32, 5, 1};
  Gemm(isa(), 3, 5, 0, dummy, dummy, Output{out.data_ptr(), ElemType::kF32, 5}, true);
  EXPECT_TRUE(at::equal(out, at::ones({3, 5})));
  Gemm(isa(), 3, 5, 0, dummy, dummy, Output{out.data_ptr(), ElemType::kF32, 5}, false);
  EXPECT_TRUE(at::equal(out, at::zeros({3, 5})));
}

// B packed ahead (PackedB) gives the bits of B packed call by call, for
// every B type and layout, rows of one or several blocks, float32 and
// bfloat16 outputs, accumulation, and the calls it hands back to the
// unpacked path (streamed rows, a tall bfloat16 output, another A type).
TEST_P(GemmOnIsa, PackedBGivesTheBitsOfPackingPerCall) {
  struct PackCase {
    int64_t m, n, k;
    ElemType a_type, b_type;
    bool b_transposed;
    ElemType out_type;
    bool accumulate;
    RowPath path;
  };
  const PackCase cases[] = {
      {13, 37, 141, ElemType::kF32, ElemType::kF32, true, ElemType::kF32, false, RowPath::kAuto},
      {97, 600, 1030, ElemType::kF32, ElemType::kF32, false, ElemType::kF32, true,
       RowPath::kBlocked},
      {200, 2100, 70, ElemType::kBF16, ElemType::kBF16, true, ElemType::kBF16, false,
       RowPath::kBlocked},
      {40, 129, 513, ElemType::kBF16, ElemType::kBF16, false, ElemType::kF32, true,
       RowPath::kBlocked},
      {130, 70, 257, ElemType::kF32, ElemType::kF8E4M3, true, ElemType::kF32, false,
       RowPath::kBlocked},
      {9, 45, 300, ElemType::kBF16, ElemType::kF8E4M3, false, ElemType::kBF16, true,
       RowPath::kBlocked},
      {5, 64, 129, ElemType::kF32, ElemType::kBF16, true, ElemType::kF32, false,
       RowPath::kStreamed},
      {300, 40, 70, ElemType::kBF16, ElemType::kBF16, true, ElemType::kBF16, true,
       RowPath::kBlocked},
      {1, 33, 2, ElemType::kF32, ElemType::kF32, false, ElemType::kF32, false, RowPath::kBlocked},
      // FP8 on whole panels and pairs, which the bfloat16-pair kernels keep
      // compactly: several k blocks, a tail block of a few pairs, both layouts.
      {130, 96, 1030, ElemType::kF32, ElemType::kF8E4M3, true, ElemType::kF32, false,
       RowPath::kBlocked},
      {40, 160, 384, ElemType::kBF16, ElemType::kF8E4M3, false, ElemType::kBF16, true,
       RowPath::kBlocked},
      {3, 64, 256, ElemType::kF32, ElemType::kF8E4M3, true, ElemType::kF32, true,
       RowPath::kBlocked},
      {130, 96, 1030, ElemType::kF32, ElemType::kI4, true, ElemType::kF32, false,
       RowPath::kBlocked},
      {9, 45, 300, ElemType::kBF16, ElemType::kI4, false, ElemType::kBF16, true, RowPath::kBlocked},
      {5, 64, 129, ElemType::kF32, ElemType::kI4, true, ElemType::kF32, false, RowPath::kStreamed},
  };
  uint64_t seed = 300;
  for (const PackCase& c : cases) {
    SCOPED_TRACE(Describe(isa(), {c.m, c.n, c.k, c.a_type, c.b_type, false, c.b_transposed,
                                  c.out_type, c.accumulate}));
    Stored a = MakeOperand(c.m, c.k, c.a_type, false, seed++);
    Stored b = MakeOperand(c.k, c.n, c.b_type, c.b_transposed, seed++);
    const PackedB packed(isa(), c.a_type, c.k, c.n, b.op);
    EXPECT_EQ(packed.bytes(), PackedB::Bytes(isa(), c.a_type, c.k, c.n, c.b_type));
    at::Tensor prior = at::randn({c.m, c.n}).to(TorchType(c.out_type));
    at::Tensor want = prior.clone(), got = prior.clone();
    Gemm(isa(), c.m, c.n, c.k, a.op, b.op, Output{want.data_ptr(), c.out_type, c.n}, c.accumulate,
         c.path);
    Gemm(isa(), c.m, a.op, packed, Output{got.data_ptr(), c.out_type, c.n}, c.accumulate, c.path);
    EXPECT_TRUE(at::equal(got, want));
    // The same pack serves an A of another type (through the per-call path).
    if (c.a_type == ElemType::kF32 && c.b_type != ElemType::kF32) {
      Stored a16 = MakeOperand(c.m, c.k, ElemType::kBF16, false, seed++);
      Gemm(isa(), c.m, c.n, c.k, a16.op, b.op, Output{want.data_ptr(), c.out_type, c.n}, false,
           c.path);
      Gemm(isa(), c.m, a16.op, packed, Output{got.data_ptr(), c.out_type, c.n}, false, c.path);
      EXPECT_TRUE(at::equal(got, want));
    }
  }
}

// Whether two tensors hold the same bytes.
bool SameBits(const at::Tensor& x, const at::Tensor& y) {
  const at::Tensor a = x.contiguous(), b = y.contiguous();
  return a.nbytes() == b.nbytes() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

// A few rows (up to 32) take the blocked path in column strips packed over
// the whole reduction; more rows take the block loop. A row's result is the
// same either way: the first rows of a taller call, bit for bit, for every
// weight type and layout, several k blocks and strips, a short last panel,
// a bfloat16 output, accumulation, rows read by index, and packs kept ahead.
TEST_P(GemmOnIsa, FewRowsGiveTheBitsOfTallerCalls) {
  struct StripCase {
    int64_t n, k;
    ElemType a_type, b_type;
    bool b_transposed;
    ElemType out_type;
    bool accumulate;
  };
  const StripCase cases[] = {
      {700, 1100, ElemType::kF32, ElemType::kF32, true, ElemType::kF32, false},
      {700, 1100, ElemType::kF32, ElemType::kF32, false, ElemType::kF32, true},
      {333, 2100, ElemType::kBF16, ElemType::kBF16, true, ElemType::kBF16, false},
      {1030, 600, ElemType::kF32, ElemType::kBF16, false, ElemType::kF32, true},
      {640, 1030, ElemType::kF32, ElemType::kF8E4M3, true, ElemType::kF32, false},
      {300, 1030, ElemType::kBF16, ElemType::kF8E4M3, false, ElemType::kBF16, true},
      {640, 1030, ElemType::kF32, ElemType::kI4, true, ElemType::kF32, false},
      {300, 1030, ElemType::kBF16, ElemType::kI4, false, ElemType::kBF16, true},
  };
  constexpr int64_t kTall = 80;
  uint64_t seed = 900;
  for (const StripCase& c : cases) {
    Stored a = MakeOperand(kTall, c.k, c.a_type, false, seed++);
    Stored b = MakeOperand(c.k, c.n, c.b_type, c.b_transposed, seed++);
    const PackedB packed(isa(), c.a_type, c.k, c.n, b.op);
    const at::Tensor prior = at::randn({kTall, c.n}).to(TorchType(c.out_type));
    at::Tensor tall = prior.clone();
    Gemm(isa(), kTall, c.n, c.k, a.op, b.op, Output{tall.data_ptr(), c.out_type, c.n}, c.accumulate,
         RowPath::kBlocked);
    for (const int64_t m : {9, 17, 32}) {
      SCOPED_TRACE(Describe(isa(), {m, c.n, c.k, c.a_type, c.b_type, false, c.b_transposed,
                                    c.out_type, c.accumulate}));
      at::Tensor got = prior.narrow(0, 0, m).clone(), kept = got.clone();
      Gemm(isa(), m, c.n, c.k, a.op, b.op, Output{got.data_ptr(), c.out_type, c.n}, c.accumulate,
           RowPath::kBlocked);
      EXPECT_TRUE(SameBits(got, tall.narrow(0, 0, m)));
      Gemm(isa(), m, a.op, packed, Output{kept.data_ptr(), c.out_type, c.n}, c.accumulate,
           RowPath::kBlocked);
      EXPECT_TRUE(SameBits(kept, tall.narrow(0, 0, m)));
      // The same rows read by index from the tall A, in reverse order.
      std::vector<int64_t> index(static_cast<size_t>(m));
      for (int64_t i = 0; i < m; ++i) index[i] = m - 1 - i;
      Operand by_index = a.op;
      by_index.row_index = index.data();
      at::Tensor reversed = prior.narrow(0, 0, m).flip(0).contiguous();
      Gemm(isa(), m, c.n, c.k, by_index, b.op, Output{reversed.data_ptr(), c.out_type, c.n},
           c.accumulate, RowPath::kBlocked);
      EXPECT_TRUE(SameBits(reversed.flip(0), tall.narrow(0, 0, m)));
    }
  }
}

// Where the kernels multiply bfloat16 pairs, an FP8 weight's pack keeps its
// byte per element (half a bfloat16 pack) when it fills whole panels and
// pairs; elsewhere, and off that grid, it takes the bfloat16 pack's size.
// (PackedBGivesTheBitsOfPackingPerCall and PackedBServesTallBfloat16Outputs
// multiply by such packs.)
TEST_P(GemmOnIsa, PackedFp8KeepsOneBytePerElementWherePairsAreMultiplied) {
  auto bytes = [&](int64_t k, int64_t n, ElemType b_type) {
    return PackedB::Bytes(isa(), ElemType::kF32, k, n, b_type);
  };
  const bool pairs = MultipliesInBf16(isa()) && MultipliesBf16Pairs(isa());
  EXPECT_EQ(bytes(1030, 96, ElemType::kF8E4M3) * (pairs ? 2 : 1), bytes(1030, 96, ElemType::kBF16));
  EXPECT_EQ(bytes(1030, 70, ElemType::kF8E4M3), bytes(1030, 70, ElemType::kBF16));
  EXPECT_EQ(bytes(1031, 96, ElemType::kF8E4M3), bytes(1031, 96, ElemType::kBF16));
  Stored b = MakeOperand(1030, 96, ElemType::kF8E4M3, true, 77);
  const PackedB packed(isa(), ElemType::kF32, 1030, 96, b.op);
  EXPECT_EQ(packed.bytes(), bytes(1030, 96, ElemType::kF8E4M3));
}

// A bfloat16 output taller than the rows the driver buffers at a time (256)
// is multiplied by the pack itself, chunk by chunk: after the source weight
// is overwritten, the packed GEMM still gives the bits of the original
// product (every chunk, the last one a single row), from every B type,
// added to C or not, all columns or some.
TEST_P(GemmOnIsa, PackedBServesTallBfloat16Outputs) {
  // Columns [c0, n) alone too: a whole FP8 scale block in, a panel wide.
  const int64_t m = 513, k = 70, n = 160, c0 = 128;
  uint64_t seed = 500;
  for (const ElemType b_type :
       {ElemType::kF32, ElemType::kBF16, ElemType::kF8E4M3, ElemType::kI4}) {
    for (const bool accumulate : {false, true}) {
      SCOPED_TRACE(Describe(
          isa(), {m, n, k, ElemType::kBF16, b_type, false, true, ElemType::kBF16, accumulate}));
      Stored a = MakeOperand(m, k, ElemType::kBF16, false, seed++);
      Stored b = MakeOperand(k, n, b_type, true, seed++);
      const PackedB packed(isa(), ElemType::kBF16, k, n, b.op);
      const at::Tensor prior = at::randn({m, n}).to(at::kBFloat16);
      at::Tensor want = prior.clone(), want_cols = prior.clone();
      Gemm(isa(), m, n, k, a.op, b.op, Output{want.data_ptr(), ElemType::kBF16, n}, accumulate,
           RowPath::kBlocked);
      Operand cols = b.op;
      cols.data = static_cast<const char*>(b.op.data) +
                  (b_type == ElemType::kI4
                       ? c0 * b.op.col_stride / 2
                       : c0 * b.op.col_stride * static_cast<int64_t>(b.data.element_size()));
      if (b_type == ElemType::kF8E4M3) cols.scales += (c0 / kScaleBlock) * b.op.scale_col_stride;
      if (b_type == ElemType::kI4) cols.group_scales += c0 * b.op.scale_col_stride;
      Gemm(isa(), m, n - c0, k, a.op, cols,
           Output{static_cast<uint16_t*>(want_cols.data_ptr()) + c0, ElemType::kBF16, n},
           accumulate, RowPath::kBlocked);
      b.data.zero_();
      at::Tensor got = prior.clone(), got_cols = prior.clone();
      Gemm(isa(), m, a.op, packed, Output{got.data_ptr(), ElemType::kBF16, n}, accumulate);
      GemmColumns(isa(), m, a.op, packed, c0, n - c0,
                  Output{static_cast<uint16_t*>(got_cols.data_ptr()) + c0, ElemType::kBF16, n},
                  accumulate);
      EXPECT_TRUE(at::equal(got, want));
      EXPECT_TRUE(at::equal(got_cols, want_cols));
    }
  }
}

// An operand read by row index (rows repeated, out of order) gives the bits
// of the same rows copied out one after another: as A on the streamed and
// blocked paths, through a packed B, in the row chunks of a tall bfloat16
// output, and as B (rows along k, as a weight gradient reads its inputs).
TEST_P(GemmOnIsa, RowIndexGivesTheBitsOfTheRowsCopiedOut) {
  struct IndexCase {
    int64_t m, n, k;
    ElemType type;
    ElemType out_type;
    bool index_b;  // B read by index (else A)
    RowPath path;
  };
  const IndexCase cases[] = {
      {5, 70, 129, ElemType::kF32, ElemType::kF32, false, RowPath::kStreamed},
      {7, 33, 64, ElemType::kBF16, ElemType::kF32, false, RowPath::kAuto},
      {97, 600, 1030, ElemType::kF32, ElemType::kF32, false, RowPath::kBlocked},
      {300, 45, 257, ElemType::kBF16, ElemType::kBF16, false, RowPath::kBlocked},
      {40, 129, 513, ElemType::kBF16, ElemType::kF32, false, RowPath::kBlocked},
      {37, 70, 300, ElemType::kF32, ElemType::kF32, true, RowPath::kBlocked},
      {64, 33, 600, ElemType::kBF16, ElemType::kF32, true, RowPath::kAuto},
      {3, 20, 45, ElemType::kF32, ElemType::kF32, true, RowPath::kStreamed},
  };
  uint64_t seed = 500;
  for (const IndexCase& c : cases) {
    SCOPED_TRACE(
        Describe(isa(), {c.m, c.n, c.k, c.type, c.type, c.index_b, false, c.out_type, false}) +
        (c.index_b ? " B by index" : " A by index"));
    // The indexed operand's stored rows: fewer than it reads, each read up
    // to three times, in a shuffled order.
    const int64_t rows = c.index_b ? c.k : c.m;
    const int64_t cols = c.index_b ? c.n : c.k;
    const int64_t stored_rows = rows / 3 + 1;
    at::manual_seed(seed++);
    at::Tensor index = at::randint(stored_rows, {rows}, at::kLong);
    Stored source = MakeOperand(stored_rows, cols + 3, c.type, false, seed++);
    // Columns 2.. of the stored rows: a row stride wider than the columns.
    at::Tensor view = source.data.narrow(1, 2, cols);
    Operand indexed = source.op;
    indexed.data = view.data_ptr();
    indexed.row_index = index.data_ptr<int64_t>();
    at::Tensor copied = view.index_select(0, index).contiguous();
    Operand plain = indexed;
    plain.data = copied.data_ptr();
    plain.row_stride = cols;
    plain.row_index = nullptr;
    // The other operand: B as a transposed weight; or A, read transposed
    // (as a weight gradient reads dY) and row-major (which the streamed path
    // takes).
    Stored other = c.index_b ? MakeOperand(c.m, c.k, c.type, true, seed++)
                             : MakeOperand(c.k, c.n, c.type, true, seed++);
    at::Tensor want = at::zeros({c.m, c.n}).to(TorchType(c.out_type));
    at::Tensor got = want.clone();
    const Output want_out{want.data_ptr(), c.out_type, c.n},
        got_out{got.data_ptr(), c.out_type, c.n};
    if (c.index_b) {
      Gemm(isa(), c.m, c.n, c.k, other.op, plain, want_out, false, c.path);
      Gemm(isa(), c.m, c.n, c.k, other.op, indexed, got_out, false, c.path);
      Stored row_major = MakeOperand(c.m, c.k, c.type, false, seed++);
      at::Tensor want_rm = want.clone().zero_(), got_rm = want.clone().zero_();
      Gemm(isa(), c.m, c.n, c.k, row_major.op, plain, Output{want_rm.data_ptr(), c.out_type, c.n},
           false, c.path);
      Gemm(isa(), c.m, c.n, c.k, row_major.op, indexed, Output{got_rm.data_ptr(), c.out_type, c.n},
           false, c.path);
      EXPECT_TRUE(at::equal(got_rm, want_rm)) << "row-major A";
    } else {
      Gemm(isa(), c.m, c.n, c.k, plain, other.op, want_out, false, c.path);
      Gemm(isa(), c.m, c.n, c.k, indexed, other.op, got_out, false, c.path);
      const PackedB packed(isa(), c.type, c.k, c.n, other.op);
      at::Tensor from_pack = want.clone().zero_();
      Gemm(isa(), c.m, indexed, packed, Output{from_pack.data_ptr(), c.out_type, c.n}, false,
           c.path);
      EXPECT_TRUE(at::equal(from_pack, want));
      // Columns from a panel boundary on (the fused gate/up's blocks).
      if (c.n > 32) {
        const int64_t col0 = 32, cols = c.n - col0;
        at::Tensor part_want = at::zeros({c.m, cols}).to(TorchType(c.out_type));
        at::Tensor part_got = part_want.clone();
        GemmColumns(isa(), c.m, plain, packed, col0, cols,
                    Output{part_want.data_ptr(), c.out_type, cols}, false, c.path);
        GemmColumns(isa(), c.m, indexed, packed, col0, cols,
                    Output{part_got.data_ptr(), c.out_type, cols}, false, c.path);
        EXPECT_TRUE(at::equal(part_got, part_want)) << "columns from " << col0;
      }
    }
    EXPECT_TRUE(at::equal(got, want));
    EXPECT_EQ(ElementValue(indexed, rows - 1, cols - 1), ElementValue(plain, rows - 1, cols - 1));
  }
  // FP8 and int4 operands and packs refuse an index.
  Stored a = MakeOperand(4, 4, ElemType::kF32, false, seed++);
  const int64_t index[4] = {0, 1, 2, 3};
  at::Tensor out = at::zeros({4, 8});
  for (const ElemType weight_only : {ElemType::kF8E4M3, ElemType::kI4}) {
    Stored w = MakeOperand(4, 8, weight_only, false, seed++);
    w.op.row_index = index;
    EXPECT_THROW(Gemm(isa(), 4, 8, 4, a.op, w.op, Output{out.data_ptr(), ElemType::kF32, 8}, false),
                 c10::Error);
  }
  Stored f32 = MakeOperand(4, 8, ElemType::kF32, false, seed++);
  f32.op.row_index = index;
  EXPECT_THROW(PackedB(isa(), ElemType::kF32, 4, 8, f32.op), c10::Error);
}

// Where the kernels multiply bfloat16 pairs, an FP8 weight is its bfloat16
// dequantization (FP8 x scale, rounded once): the same bits as that bfloat16
// weight on the streamed path (a few rows) and the blocked one, for B read
// as Wᵀ (forward) and as W (dX), with float32 and bfloat16 A. Elsewhere FP8 x
// scale stays float32, unrounded, so the bits differ from the bfloat16
// weight's.
TEST_P(GemmOnIsa, Fp8WeightsMultiplyAsTheirBfloat16Dequantization) {
  const int64_t n = 300, k = 260;  // partial scale blocks both ways
  for (const bool transposed : {true, false}) {
    Stored w = MakeOperand(k, n, ElemType::kF8E4M3, transposed, 21);
    const Dequantized deq = Bf16Dequantization(w);
    const Operand& d = deq.op;
    for (const ElemType a_type : {ElemType::kF32, ElemType::kBF16}) {
      for (const int64_t m : {1, 5, 8, 9, 40}) {
        SCOPED_TRACE(::testing::Message()
                     << "Wᵀ " << transposed << " A " << (a_type == ElemType::kF32 ? "f32" : "bf16")
                     << " m " << m);
        Stored a = MakeOperand(m, k, a_type, false, 22);
        at::Tensor from_fp8 = at::empty({m, n}), from_bf16 = at::empty({m, n});
        Gemm(isa(), m, n, k, a.op, w.op, Output{from_fp8.data_ptr(), ElemType::kF32, n}, false);
        Gemm(isa(), m, n, k, a.op, d, Output{from_bf16.data_ptr(), ElemType::kF32, n}, false);
        if (MultipliesInBf16(isa())) {
          EXPECT_TRUE(at::equal(from_fp8, from_bf16));
        } else {
          EXPECT_FALSE(at::equal(from_fp8, from_bf16));  // float32 x scale, unrounded
        }
      }
    }
  }
}

// An int4 weight is its bfloat16 dequantization on every instruction set:
// the same bits as that bfloat16 weight, on the streamed path (up to 8
// rows) and the blocked one (strips and blocks), read as Wᵀ (forward) and as
// W (dX), float32 and bfloat16 A and outputs, added to C or not, packed
// ahead or call by call, and columns from a group on. Groups of 32 and 128,
// groups that are not whole vectors (8: the scalar paths), partial last
// groups, rows of a length that is not a multiple of 8, zero points.
TEST_P(GemmOnIsa, Int4WeightsMultiplyAsTheirBfloat16Dequantization) {
  struct Int4Case {
    int64_t n, k;
    Int4Groups groups;
  };
  const Int4Case cases[] = {
      {160, 256, {32, false}},   // whole groups and panels
      {300, 260, {128, false}},  // partial last groups both ways
      {77, 101, {32, true}},     // odd sizes: rows of 101 or 77 nibbles
      {96, 200, {8, true}},      // groups narrower than a vector
      {64, 1030, {128, true}},   // several k blocks
  };
  uint64_t seed = 40;
  for (const Int4Case& c : cases) {
    for (const bool transposed : {true, false}) {
      const Stored w = MakeInt4Operand(c.k, c.n, transposed, c.groups, seed++);
      const Dequantized deq = Bf16Dequantization(w);
      // The kernels' reference value of each element is the library's.
      for (int64_t kk = 0; kk < c.k; kk += 7) {
        for (int64_t j = 0; j < c.n; j += 5) {
          ASSERT_EQ(ElementValue(w.op, kk, j), ElementValue(deq.op, kk, j))
              << "element (" << kk << ", " << j << ")";
        }
      }
      for (const ElemType a_type : {ElemType::kF32, ElemType::kBF16}) {
        const PackedB packed_i4(isa(), a_type, c.k, c.n, w.op);
        const PackedB packed_bf16(isa(), a_type, c.k, c.n, deq.op);
        EXPECT_EQ(packed_i4.bytes(), packed_bf16.bytes());
        for (const int64_t m : {1, 3, 8, 9, 33, 100}) {
          const ElemType out_type = m % 2 == 0 ? ElemType::kBF16 : ElemType::kF32;
          const bool accumulate = m % 3 == 0;
          SCOPED_TRACE(::testing::Message()
                       << "n " << c.n << " k " << c.k << " group " << c.groups.size
                       << (c.groups.zero_points ? " asymmetric" : "") << " Wᵀ " << transposed
                       << " A " << (a_type == ElemType::kF32 ? "f32" : "bf16") << " m " << m);
          Stored a = MakeOperand(m, c.k, a_type, false, seed++);
          const at::Tensor prior = at::randn({m, c.n}).to(TorchType(out_type));
          at::Tensor from_i4 = prior.clone(), from_bf16 = prior.clone();
          at::Tensor kept_i4 = prior.clone(), kept_bf16 = prior.clone();
          const Output o_i4{from_i4.data_ptr(), out_type, c.n},
              o_bf16{from_bf16.data_ptr(), out_type, c.n};
          Gemm(isa(), m, c.n, c.k, a.op, w.op, o_i4, accumulate);
          Gemm(isa(), m, c.n, c.k, a.op, deq.op, o_bf16, accumulate);
          EXPECT_TRUE(SameBits(from_i4, from_bf16));
          Gemm(isa(), m, a.op, packed_i4, Output{kept_i4.data_ptr(), out_type, c.n}, accumulate);
          Gemm(isa(), m, a.op, packed_bf16, Output{kept_bf16.data_ptr(), out_type, c.n},
               accumulate);
          EXPECT_TRUE(SameBits(kept_i4, kept_bf16));
          EXPECT_TRUE(SameBits(kept_i4, from_bf16));
          // Columns from the second group (read as W) or panel (Wᵀ) on.
          const int64_t col0 = transposed ? 32 : c.groups.size;
          if (col0 < c.n) {
            at::Tensor part_i4 = at::zeros({m, c.n - col0}).to(TorchType(out_type));
            at::Tensor part_bf16 = part_i4.clone();
            GemmColumns(isa(), m, a.op, packed_i4, col0, c.n - col0,
                        Output{part_i4.data_ptr(), out_type, c.n - col0}, false);
            GemmColumns(isa(), m, a.op, packed_bf16, col0, c.n - col0,
                        Output{part_bf16.data_ptr(), out_type, c.n - col0}, false);
            EXPECT_TRUE(SameBits(part_i4, part_bf16)) << "columns from " << col0;
          }
        }
      }
    }
  }
}

// Every nibble with every zero point and a range of scales decodes as c10's
// bfloat16 of (q - z) x scale, on each instruction set's kernels (B times
// rows of an identity A, on the streamed and blocked paths, both layouts).
TEST(Gemm, KernelsDecodeEveryInt4ValueAsC10) {
  const int64_t k = 64, n = 256, group = 32;
  for (const bool transposed : {true, false}) {
    Stored w = MakeInt4Operand(k, n, transposed, {group, true}, 5);
    const int64_t stored_cols = w.stored_cols, num_groups = w.scales.size(1);
    // Stored element (r, c): nibble (r + c) % 16; group (r, g): zero point
    // (r + g) % 16 - 8 and a scale from 2^-5 to 2^5.
    auto scale_of = [](int64_t r, int64_t g) {
      return static_cast<float>(c10::BFloat16(std::ldexp(
          1.0f + static_cast<float>((r + 3 * g) % 7) / 7.0f, static_cast<int>((r + g) % 11) - 5)));
    };
    uint8_t* bytes = w.data.data_ptr<uint8_t>();
    const int64_t row_bytes = w.data.size(1);
    for (int64_t r = 0; r < w.data.size(0); ++r) {
      for (int64_t c = 0; c < stored_cols; ++c) {
        const uint8_t u = static_cast<uint8_t>((r + c) % 16);
        uint8_t& byte = bytes[r * row_bytes + c / 2];
        byte = static_cast<uint8_t>(c % 2 == 0 ? (byte & 0xf0) | u : (byte & 0x0f) | (u << 4));
      }
      for (int64_t g = 0; g < num_groups; ++g) {
        w.zeros[r][g] = static_cast<int8_t>((r + g) % 16 - 8);
        w.scales[r][g] = scale_of(r, g);
      }
    }
    at::Tensor values = at::empty({k, n});
    for (int64_t kk = 0; kk < k; ++kk) {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t r = transposed ? j : kk, c = transposed ? kk : j, g = c / group;
        const int q = static_cast<int>((r + c) % 16) - 8, z = static_cast<int>((r + g) % 16) - 8;
        const float want =
            static_cast<float>(c10::BFloat16(static_cast<float>(q - z) * scale_of(r, g)));
        values[kk][j] = want;
        ASSERT_EQ(ElementValue(w.op, kk, j), want) << kk << ", " << j;
      }
    }
    for (Isa isa : kAllIsas) {
      if (static_cast<int>(isa) > static_cast<int>(DetectIsa())) continue;
      for (const int64_t m : {1, 8, 32, 40}) {
        // Row i of the identity picks row i % k of B.
        at::Tensor a = at::zeros({m, k});
        for (int64_t i = 0; i < m; ++i) a[i][i % k] = 1.0f;
        const Operand a_op{a.data_ptr(), ElemType::kF32, k, 1};
        at::Tensor out = at::empty({m, n});
        Gemm(isa, m, n, k, a_op, w.op, Output{out.data_ptr(), ElemType::kF32, n}, false);
        for (int64_t i = 0; i < m; ++i) {
          EXPECT_TRUE(at::equal(out[i], values[i % k]))
              << IsaName(isa) << " m " << m << " row " << i << (transposed ? " Wᵀ" : " W");
        }
      }
    }
  }
}

// The same products on every instruction set that computes them in float32
// agree to float32 rounding: a narrower set is a twin of a wider one.
TEST(Gemm, Float32PathsAgreeAcrossInstructionSets) {
  Stored a = MakeOperand(50, 300, ElemType::kBF16, false, 7);
  Stored b = MakeOperand(300, 90, ElemType::kBF16, true, 8);
  at::Tensor ref = at::empty({50, 90});
  Gemm(Isa::kPortable, 50, 90, 300, a.op, b.op, Output{ref.data_ptr(), ElemType::kF32, 90}, false);
  for (Isa isa : kAllIsas) {
    if (static_cast<int>(isa) > static_cast<int>(DetectIsa())) continue;
    at::Tensor out = at::empty({50, 90});
    Gemm(isa, 50, 90, 300, a.op, b.op, Output{out.data_ptr(), ElemType::kF32, 90}, false);
    // bf16 x bf16 products are exact in float32, so even the pairs kernel
    // differs from the others only in summation order.
    EXPECT_LT((out - ref).abs().max().item<double>(), 1e-4 * ref.abs().max().item<double>())
        << IsaName(isa);
  }
}

// Every FP8 byte, decoded by each instruction set's kernels (blocked and
// streamed paths alike: B is multiplied by 1), equals c10's value.
TEST(Gemm, KernelsDecodeEveryFp8ByteAsC10) {
  std::vector<uint8_t> bytes(256);
  for (int v = 0; v < 256; ++v) bytes[v] = static_cast<uint8_t>(v);
  const float scale = 1.0f;
  const float one = 1.0f;
  // B [1, 256] (k = 1), A [1, 1] = 1: C[0, j] is byte j's value.
  const Operand b{bytes.data(), ElemType::kF8E4M3, 256, 1, &scale, 0, 0};
  const Operand a{&one, ElemType::kF32, 1, 1};
  for (Isa isa : kAllIsas) {
    if (static_cast<int>(isa) > static_cast<int>(DetectIsa())) continue;
    for (RowPath path : {RowPath::kBlocked, RowPath::kStreamed}) {
      std::vector<float> out(256);
      Gemm(isa, 1, 256, 1, a, b, Output{out.data(), ElemType::kF32, 256}, false, path);
      for (int v = 0; v < 256; ++v) {
        const float want =
            static_cast<float>(c10::Float8_e4m3fn(bytes[v], c10::Float8_e4m3fn::from_bits()));
        if (std::isnan(want)) {
          EXPECT_TRUE(std::isnan(out[v])) << IsaName(isa) << " byte " << v;
        } else {
          EXPECT_EQ(out[v], want) << IsaName(isa) << " byte " << v;
        }
      }
    }
  }
}

// A k x n FP8 B of random bytes (NaN included when nan_bytes), stored
// [k, n] (read as is: n-contiguous) or, transposed, [n, k] (Wᵀ:
// k-contiguous), with block scales of either sign, tiny (subnormal bfloat16
// products) and huge (infinite ones) among ordinary ones.
struct OddFp8 {
  at::Tensor bytes, scales;
  Operand op;
};

OddFp8 MakeOddFp8(int64_t k, int64_t n, bool transposed, bool nan_bytes, uint64_t seed) {
  at::manual_seed(seed);
  OddFp8 w;
  w.bytes =
      transposed ? at::randint(0, 256, {n, k}, at::kByte) : at::randint(0, 256, {k, n}, at::kByte);
  if (!nan_bytes) w.bytes.masked_fill_((w.bytes == 0x7f).logical_or(w.bytes == 0xff), 0x42);
  const int64_t sr = (w.bytes.size(0) + kScaleBlock - 1) / kScaleBlock;
  const int64_t sc = (w.bytes.size(1) + kScaleBlock - 1) / kScaleBlock;
  w.scales = at::rand({sr, sc}).add_(0.5).div_(100);
  float* sp = w.scales.data_ptr<float>();
  const float odd[] = {-0.013f, 1e-39f, 1e36f, -2e-42f};
  for (int64_t i = 0; i < sr * sc && i < 4; ++i) sp[(i * 5) % (sr * sc)] = odd[i];
  w.op =
      Operand{w.bytes.data_ptr(),  ElemType::kF8E4M3,  transposed ? 1 : n, transposed ? k : 1, sp,
              transposed ? 1 : sc, transposed ? sc : 1};
  return w;
}

// The FP8 lookup tables (internal/fp8_tables.h) against the decoder they
// stand in for, on the sets that multiply in bfloat16: the same bits for
// every row count they can take (kFp8TableMaxRows), both weight layouts, both activation and output
// types, with and without accumulation, at sizes that cut the 64-byte runs,
// the 16-lane vectors and the 128 x 128 scale blocks short. The bytes take
// every value (NaN included, in a case of its own, since one NaN makes its
// whole output column NaN) and the block scales are of either sign, tiny
// (subnormal bfloat16 products) and huge (infinite ones).
TEST(Gemm, Fp8TablesGiveTheDecodersBits) {
  if (!internal::Fp8TablesUsable()) {
    GTEST_SKIP() << "no AVX-512 VBMI on this CPU (" << CpuFlags()
                 << "); the tables run on CPUs that have it";
  }
  struct Shape {
    int64_t k, n;
    bool nan_bytes;
  };
  const Shape shapes[] = {{300, 260, false}, {1000, 77, false}, {17, 129, false},
                          {15, 16, false},   {130, 5, false},   {64, 200, true}};
  // Every row count the tables can take, whatever this CPU's limits.
  internal::SetFp8TableRows(
      internal::Fp8TableRowLimits{internal::kFp8TableMaxRows, internal::kFp8TableMaxRows});
  int64_t compared = 0;
  for (const Isa isa : {Isa::kAvx512Bf16, Isa::kAmxBf16}) {
    if (static_cast<int>(isa) > static_cast<int>(DetectIsa())) continue;
    for (const Shape& shape : shapes) {
      for (const bool transposed : {true, false}) {
        const OddFp8 w =
            MakeOddFp8(shape.k, shape.n, transposed, shape.nan_bytes, shape.k * 7 + shape.n);
        const Operand& b = w.op;
        for (const ElemType a_type : {ElemType::kF32, ElemType::kBF16}) {
          for (int64_t m = 1; m <= internal::kFp8TableMaxRows; ++m) {
            for (const ElemType out_type : {ElemType::kF32, ElemType::kBF16}) {
              for (const bool accumulate : {false, true}) {
                SCOPED_TRACE(
                    ::testing::Message()
                    << IsaName(isa) << " k " << shape.k << " n " << shape.n << " Wᵀ " << transposed
                    << " m " << m << " A " << (a_type == ElemType::kF32 ? "f32" : "bf16") << " out "
                    << (out_type == ElemType::kF32 ? "f32" : "bf16") << " +=" << accumulate);
                Stored a = MakeOperand(m, shape.k, a_type, false, 31 + m);
                const at::Tensor prior = at::randn({m, shape.n}).to(TorchType(out_type));
                at::Tensor by_tables = prior.clone(), by_decoder = prior.clone();
                Gemm(isa, m, shape.n, shape.k, a.op, b,
                     Output{by_tables.data_ptr(), out_type, shape.n}, accumulate,
                     RowPath::kStreamed);
                internal::SetFp8TablesEnabled(false);
                Gemm(isa, m, shape.n, shape.k, a.op, b,
                     Output{by_decoder.data_ptr(), out_type, shape.n}, accumulate,
                     RowPath::kStreamed);
                internal::SetFp8TablesEnabled(true);
                EXPECT_EQ(
                    std::memcmp(by_tables.data_ptr(), by_decoder.data_ptr(), by_tables.nbytes()),
                    0);
                ++compared;
              }
            }
          }
        }
      }
    }
  }
  internal::SetFp8TableRows(std::nullopt);
  EXPECT_GT(compared, 0);
}

// The tables' row limits are measured on this CPU within what they can
// take, and a held limit is followed: the tables take a call of that many
// rows and hand one more to the decoder.
TEST(Gemm, Fp8TablesTakeTheRowsOfTheirLimits) {
  if (!internal::Fp8TablesUsable() ||
      static_cast<int>(DetectIsa()) < static_cast<int>(Isa::kAvx512Bf16)) {
    GTEST_SKIP() << "no AVX-512 BF16 and VBMI on this CPU (" << CpuFlags() << ")";
  }
  const internal::Fp8TableRowLimits measured = internal::Fp8TableRows();
  for (const int64_t rows : {measured.k_contiguous, measured.n_contiguous}) {
    EXPECT_GE(rows, 0);
    EXPECT_LE(rows, internal::kFp8TableMaxRows);
  }
  std::printf("FP8 lookup tables measured here up to %lld rows (Wᵀ) and %lld (W)\n",
              static_cast<long long>(measured.k_contiguous),
              static_cast<long long>(measured.n_contiguous));
  for (const bool transposed : {true, false}) {
    const OddFp8 w = MakeOddFp8(256, 160, transposed, /*nan_bytes=*/false, 91);
    Stored a = MakeOperand(5, 256, ElemType::kF32, false, 92);
    at::Tensor c = at::zeros({5, 160});
    const Output out{c.data_ptr(), ElemType::kF32, 160};
    internal::SetFp8TableRows(internal::Fp8TableRowLimits{4, 4});
    EXPECT_TRUE(internal::StreamFp8ByTables(4, 160, 256, a.op, w.op, out, false));
    EXPECT_FALSE(internal::StreamFp8ByTables(5, 160, 256, a.op, w.op, out, false));
    internal::SetFp8TableRows(internal::Fp8TableRowLimits{0, 0});
    EXPECT_FALSE(internal::StreamFp8ByTables(1, 160, 256, a.op, w.op, out, false));
  }
  internal::SetFp8TableRows(std::nullopt);
  EXPECT_EQ(internal::Fp8TableRows().k_contiguous, measured.k_contiguous);
}

// Equal values, NaN where the other is NaN: which NaN an FP8 NaN byte
// becomes differs between the per-call packing's vector body and its
// scalar tail, and a sum's NaN follows its inputs'.
bool SameValues(const at::Tensor& got, const at::Tensor& want) {
  return at::allclose(got, want, /*rtol=*/0.0, /*atol=*/0.0, /*equal_nan=*/true);
}

// An FP8 weight kept compactly (its bytes in the bfloat16-pair panels'
// order, expanded block by block as a GEMM reads it) gives the values of
// packing it per call, through the lookup tables and through the arithmetic
// expansion: on both pairs kernels, both layouts, several k blocks and a
// short last one, column ranges, and scales whose products are float32
// subnormals (where the tables and vcvtneps2bf16 round differently and the
// kernels multiply both as zero), huge or negative, with NaN bytes.
TEST(Gemm, CompactFp8PacksMultiplyAsPackingPerCall) {
  struct Shape {
    int64_t k, n;
  };
  const Shape shapes[] = {{1030, 96}, {300, 160}, {64, 32}};
  int64_t compared = 0;
  for (const Isa isa : {Isa::kAvx512Bf16, Isa::kAmxBf16}) {
    if (static_cast<int>(isa) > static_cast<int>(DetectIsa())) continue;
    internal::SetBf16Pairs(true);
    for (const bool tables : {true, false}) {
      if (tables && !internal::Fp8TablesUsable()) continue;
      internal::SetFp8TablesEnabled(tables);
      for (const Shape& shape : shapes) {
        for (const bool transposed : {true, false}) {
          const OddFp8 w =
              MakeOddFp8(shape.k, shape.n, transposed, /*nan_bytes=*/true, shape.k + 3 * shape.n);
          const Operand& b = w.op;
          for (const ElemType a_type : {ElemType::kF32, ElemType::kBF16}) {
            const PackedB packed(isa, a_type, shape.k, shape.n, b);
            ASSERT_EQ(packed.bytes() * 2,
                      PackedB::Bytes(isa, a_type, shape.k, shape.n, ElemType::kBF16));
            for (const int64_t m : {9, 40, 130}) {
              SCOPED_TRACE(::testing::Message()
                           << IsaName(isa) << " tables " << tables << " k " << shape.k << " n "
                           << shape.n << " Wᵀ " << transposed << " m " << m);
              Stored a = MakeOperand(m, shape.k, a_type, false, 60 + m);
              at::Tensor want = at::zeros({m, shape.n}), got = at::zeros({m, shape.n});
              Gemm(isa, m, shape.n, shape.k, a.op, b,
                   Output{want.data_ptr(), ElemType::kF32, shape.n}, false, RowPath::kBlocked);
              Gemm(isa, m, a.op, packed, Output{got.data_ptr(), ElemType::kF32, shape.n}, false,
                   RowPath::kBlocked);
              EXPECT_TRUE(SameValues(got, want));
              // The columns from the second scale block on.
              if (shape.n > kScaleBlock) {
                at::Tensor cols = at::zeros({m, shape.n});
                GemmColumns(isa, m, a.op, packed, kScaleBlock, shape.n - kScaleBlock,
                            Output{cols.data_ptr<float>() + kScaleBlock, ElemType::kF32, shape.n},
                            false, RowPath::kBlocked);
                EXPECT_TRUE(SameValues(cols.slice(1, kScaleBlock), want.slice(1, kScaleBlock)));
              }
              ++compared;
            }
          }
        }
      }
    }
    internal::SetFp8TablesEnabled(true);
    internal::SetBf16Pairs(std::nullopt);
  }
  if (compared == 0) {
    GTEST_SKIP() << "no AVX-512 BF16 on this CPU (" << CpuFlags() << ")";
  }
}

// The blocked path's per-call packing of an FP8 weight through the lookup
// tables gives the values of the arithmetic decoder's packing: both pairs
// kernels, both layouts, several k blocks, k not a multiple of 64 (the tables
// take what they can, the decoder the rest), a last panel of fewer than 32
// columns, column blocks after the first (n above 512), scales whose
// products are float32 subnormals, huge or negative ones, NaN bytes. And the
// tables do take the whole panels, up to the k they say.
TEST(Gemm, Fp8PerCallPacksByTablesMultiplyAsTheDecoders) {
  if (!internal::Fp8TablesUsable()) {
    GTEST_SKIP() << "no AVX-512 VBMI on this CPU (" << CpuFlags()
                 << "); the tables run on CPUs that have it";
  }
  struct Shape {
    int64_t k, n;
  };
  const Shape shapes[] = {{1030, 96}, {300, 160}, {64, 32}, {257, 77}, {130, 600}};
  int64_t compared = 0;
  for (const Isa isa : {Isa::kAvx512Bf16, Isa::kAmxBf16}) {
    if (static_cast<int>(isa) > static_cast<int>(DetectIsa())) continue;
    internal::SetBf16Pairs(true);
    for (const Shape& shape : shapes) {
      for (const bool transposed : {true, false}) {
        const OddFp8 w =
            MakeOddFp8(shape.k, shape.n, transposed, /*nan_bytes=*/true, shape.k + 5 * shape.n);
        const Operand& b = w.op;
        const int64_t panels = shape.n / 32;
        std::vector<float> pack(static_cast<size_t>((panels + 1) * 32 * (shape.k + 32)));
        const int64_t want_k = transposed ? shape.k / 64 * 64 : shape.k / 2 * 2;
        EXPECT_EQ(internal::PackFp8PairsByTables(16, b, 0, shape.k, 0, panels, pack.data()),
                  panels > 0 ? want_k : 0);
        for (const int64_t m : {9, 40}) {
          SCOPED_TRACE(::testing::Message() << IsaName(isa) << " k " << shape.k << " n " << shape.n
                                            << " Wᵀ " << transposed << " m " << m);
          Stored a = MakeOperand(m, shape.k, ElemType::kF32, false, 70 + m);
          at::Tensor by_tables = at::zeros({m, shape.n}), by_decoder = at::zeros({m, shape.n});
          Gemm(isa, m, shape.n, shape.k, a.op, b,
               Output{by_tables.data_ptr(), ElemType::kF32, shape.n}, false, RowPath::kBlocked);
          internal::SetFp8TablesEnabled(false);
          Gemm(isa, m, shape.n, shape.k, a.op, b,
               Output{by_decoder.data_ptr(), ElemType::kF32, shape.n}, false, RowPath::kBlocked);
          internal::SetFp8TablesEnabled(true);
          EXPECT_TRUE(SameValues(by_tables, by_decoder));
          ++compared;
        }
      }
    }
    internal::SetBf16Pairs(std::nullopt);
  }
  if (compared == 0) {
    GTEST_SKIP() << "no AVX-512 BF16 on this CPU (" << CpuFlags() << ")";
  }
}

// A bfloat16 output is the float32 result rounded to nearest even, as c10
// rounds, on every instruction set's float32 kernels (the bfloat16-pairs
// kernels of avx512_bf16 and amx_bf16 store with the same AVX-512 function):
// halfway cases both ways, either sign,
// overflow to infinity, subnormals, infinities and NaN (any NaN), written
// afresh and added to what the output holds. C = A x ones(1, n), so each
// row repeats one crafted value across a row longer than a vector.
TEST(Gemm, Bfloat16OutputRoundsAsC10) {
  const uint32_t bits[] = {0x00000000, 0x3f800000, 0x3f808000, 0x3f818000, 0x3f808001, 0x3f807fff,
                           0xbf808000, 0xbf818000, 0x7f7fffff, 0x7f7f7fff, 0xff7fffff, 0x7f800000,
                           0xff800000, 0x00000001, 0x00008000, 0x00018000, 0x007fffff, 0x80018000,
                           0x7fc00000, 0xffc00000, 0x7f800001, 0x41c98000, 0xc2fe8000, 0x3dcccccd,
                           0x4b7fffff, 0x387fc000, 0x477fe000, 0x47800000};
  const int64_t n = 29;
  std::vector<float> a(std::size(bits));
  for (size_t i = 0; i < a.size(); ++i) std::memcpy(&a[i], &bits[i], 4);
  const std::vector<float> ones(n, 1.0f);
  const Operand a_op{a.data(), ElemType::kF32, 1, 1};
  const Operand b_op{ones.data(), ElemType::kF32, n, 1};
  auto c10_bits = [](float f) { return c10::BFloat16(f).x; };
  auto from_bits = [](uint16_t b) {
    return static_cast<float>(c10::BFloat16(b, c10::BFloat16::from_bits()));
  };
  for (Isa isa : kAllIsas) {
    if (static_cast<int>(isa) > static_cast<int>(DetectIsa())) continue;
    // Streamed (the first 8 values) and blocked.
    for (RowPath path : {RowPath::kStreamed, RowPath::kBlocked}) {
      const int64_t m = path == RowPath::kStreamed ? 8 : std::ssize(bits);
      std::vector<float> wide(m * n);
      Gemm(isa, m, n, 1, a_op, b_op, Output{wide.data(), ElemType::kF32, n}, false, path);
      std::vector<uint16_t> fresh(m * n), added(m * n);
      for (int64_t i = 0; i < m * n; ++i)
        added[i] = c10_bits(0.37f * static_cast<float>(i % 7) - 1);
      const std::vector<uint16_t> before = added;
      Gemm(isa, m, n, 1, a_op, b_op, Output{fresh.data(), ElemType::kBF16, n}, false, path);
      Gemm(isa, m, n, 1, a_op, b_op, Output{added.data(), ElemType::kBF16, n}, true, path);
      for (int64_t i = 0; i < m * n; ++i) {
        const float v = wide[i];
        const std::string where = std::string(IsaName(isa)) + " value " + std::to_string(i / n);
        if (!std::isnan(a[i / n])) {
          ASSERT_EQ(v, a[i / n]) << where;
        }
        const float sum = from_bits(before[i]) + v;
        if (std::isnan(v)) {
          EXPECT_TRUE(std::isnan(from_bits(fresh[i]))) << where;
        } else {
          EXPECT_EQ(fresh[i], c10_bits(v)) << where;
        }
        if (std::isnan(sum)) {
          EXPECT_TRUE(std::isnan(from_bits(added[i]))) << where;
        } else {
          EXPECT_EQ(added[i], c10_bits(sum)) << where;
        }
      }
    }
  }
}

// avx512_bf16's widened form is the avx512 kernels on the weights' bfloat16
// values: the bits of avx512 multiplying the bfloat16 weight itself, or an
// FP8 weight's bfloat16 dequantization, on the blocked path (packed per call
// and packed ahead), for both weight layouts, both activation and output
// types, with and without accumulation, over several k, m and scale blocks.
TEST(Gemm, WidenedAvx512Bf16GivesTheBitsOfAvx512OnBfloat16Values) {
  if (static_cast<int>(DetectIsa()) < static_cast<int>(Isa::kAvx512Bf16)) {
    GTEST_SKIP() << "no AVX-512 BF16 on this CPU (" << CpuFlags()
                 << "); the widened kernels run on CPUs that have it";
  }
  internal::SetBf16Pairs(false);
  const int64_t k = 300, n = 260;
  int64_t compared = 0;
  for (const ElemType w_type : {ElemType::kBF16, ElemType::kF8E4M3}) {
    for (const bool transposed : {true, false}) {
      Stored w = MakeOperand(k, n, w_type, transposed, 41);
      // The bfloat16 values the widened kernels multiply.
      const Dequantized deq =
          w_type == ElemType::kF8E4M3 ? Bf16Dequantization(w) : Dequantized{w.data, w.op};
      const Operand& v = deq.op;
      for (const ElemType a_type : {ElemType::kF32, ElemType::kBF16}) {
        const PackedB packed(Isa::kAvx512Bf16, a_type, k, n, w.op);
        for (const int64_t m : {9, 40, 130}) {
          for (const ElemType out_type : {ElemType::kF32, ElemType::kBF16}) {
            for (const bool accumulate : {false, true}) {
              SCOPED_TRACE(::testing::Message()
                           << (w_type == ElemType::kBF16 ? "bf16" : "f8") << " Wᵀ " << transposed
                           << " A " << (a_type == ElemType::kF32 ? "f32" : "bf16") << " m " << m
                           << " out " << (out_type == ElemType::kF32 ? "f32" : "bf16")
                           << " +=" << accumulate);
              Stored a = MakeOperand(m, k, a_type, false, 42 + m);
              const at::Tensor prior = at::randn({m, n}).to(TorchType(out_type));
              at::Tensor widened = prior.clone(), ahead = prior.clone(), ref = prior.clone();
              Gemm(Isa::kAvx512Bf16, m, n, k, a.op, w.op, Output{widened.data_ptr(), out_type, n},
                   accumulate, RowPath::kBlocked);
              Gemm(Isa::kAvx512Bf16, m, a.op, packed, Output{ahead.data_ptr(), out_type, n},
                   accumulate, RowPath::kBlocked);
              Gemm(Isa::kAvx512, m, n, k, a.op, v, Output{ref.data_ptr(), out_type, n}, accumulate,
                   RowPath::kBlocked);
              EXPECT_EQ(std::memcmp(widened.data_ptr(), ref.data_ptr(), ref.nbytes()), 0);
              EXPECT_EQ(std::memcmp(ahead.data_ptr(), ref.data_ptr(), ref.nbytes()), 0);
              ++compared;
            }
          }
        }
      }
    }
  }
  internal::SetBf16Pairs(std::nullopt);
  EXPECT_EQ(compared, 2 * 2 * 2 * 3 * 2 * 2);
}

// avx512_bf16 multiplies in bfloat16 pairs where this CPU's vdpbf16ps gives
// more multiply-adds per second than its float32 FMA, as measured once; the
// measurement is stable enough that every process on a machine chooses
// alike; SetBf16Pairs holds either form; the other sets are fixed.
TEST(Isa, Avx512Bf16MultipliesInPairsWhereTheyAreFaster) {
  EXPECT_TRUE(MultipliesBf16Pairs(Isa::kAmxBf16));
  EXPECT_FALSE(MultipliesBf16Pairs(Isa::kAvx512));
  EXPECT_FALSE(MultipliesBf16Pairs(Isa::kAvx2));
  if (static_cast<int>(DetectIsa()) < static_cast<int>(Isa::kAvx512Bf16)) {
    EXPECT_EQ(Bf16PairSpeed(), 0.0);
    GTEST_SKIP() << "no AVX-512 BF16 on this CPU (" << CpuFlags() << ")";
  }
  const double speed = Bf16PairSpeed();
  EXPECT_GT(speed, 0.1);
  EXPECT_LT(speed, 10.0);
  EXPECT_EQ(Bf16PairSpeed(), speed);  // measured once per process
  const double again = internal::MeasureBf16PairSpeed();
  EXPECT_GT(again, speed / 1.5);
  EXPECT_LT(again, speed * 1.5);
  EXPECT_EQ(MultipliesBf16Pairs(Isa::kAvx512Bf16), speed > 1.0);
  EXPECT_NE(IsaDescription(Isa::kAvx512Bf16).find(speed > 1.0 ? "pairs" : "widened"),
            std::string::npos)
      << IsaDescription(Isa::kAvx512Bf16);
  internal::SetBf16Pairs(true);
  EXPECT_TRUE(MultipliesBf16Pairs(Isa::kAvx512Bf16));
  EXPECT_NE(IsaDescription(Isa::kAvx512Bf16).find("pairs"), std::string::npos);
  internal::SetBf16Pairs(false);
  EXPECT_FALSE(MultipliesBf16Pairs(Isa::kAvx512Bf16));
  EXPECT_NE(IsaDescription(Isa::kAvx512Bf16).find("widened"), std::string::npos);
  internal::SetBf16Pairs(std::nullopt);
  EXPECT_EQ(MultipliesBf16Pairs(Isa::kAvx512Bf16), speed > 1.0);
  EXPECT_EQ(IsaDescription(Isa::kAvx512), "avx512");
}

TEST(Isa, LimitHoldsTheKernelsNarrower) {
  const Isa before = ActiveIsa();
  LimitIsa(Isa::kPortable);
  EXPECT_EQ(ActiveIsa(), Isa::kPortable);
  LimitIsa(Isa::kAmxBf16);  // clamped to what the CPU has
  EXPECT_EQ(ActiveIsa(), before);
  EXPECT_FALSE(CpuFlags().empty());
}

// A CPU with AMX-BF16 runs the amx_bf16 kernels unless the operating system
// refuses the tile state, which CpuFlags() then says; one without never does.
TEST(Isa, AmxWhereTheCpuAndTheOsAllowIt) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("amx-bf16")) {
    EXPECT_NE(DetectIsa(), Isa::kAmxBf16);
    GTEST_SKIP() << "no AMX on this CPU (" << CpuFlags() << ")";
  }
  if (DetectIsa() != Isa::kAmxBf16) {
    EXPECT_NE(CpuFlags().find("refused by the OS"), std::string::npos) << CpuFlags();
  } else {
    EXPECT_NE(CpuFlags().find("amx_bf16"), std::string::npos) << CpuFlags();
  }
}

INSTANTIATE_TEST_SUITE_P(All, GemmOnIsa,
                         ::testing::Values(Form{Isa::kPortable}, Form{Isa::kAvx2},
                                           Form{Isa::kAvx512}, Form{Isa::kAvx512Bf16, true},
                                           Form{Isa::kAvx512Bf16, false}, Form{Isa::kAmxBf16}),
                         [](const ::testing::TestParamInfo<Form>& info) {
                           return FormName(info.param);
                         });

}  // namespace
}  // namespace moefit::experts::kernels
