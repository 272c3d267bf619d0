// moefit's expert GEMM (experts/kernels/gemm.h) on one core, per instruction
// set and weight format (float32, bfloat16, FP8 with 128 x 128 block scales,
// int4 with a bfloat16 scale per 32 inputs), against two ceilings measured
// in the same run:
//
//   * compute: LibTorch's float32 mm (MKL/oneDNN) of the same shape, one
//     thread -- for a block of rows big enough to be compute-bound;
//   * memory:  the time to read the weight bytes once at the bandwidth a
//     plain sum over an uncached buffer reaches -- for small blocks (a few
//     tokens per expert), where streaming the weight is the floor.
//
// One "expert pass" is what the layer does per expert: forward gate|up
// (m x 2I x H) and down (m x H x I); backward dX through both (the same
// FLOPs again); and, for trainable formats, the two weight gradients. Each
// pass cycles through distinct experts' weights so that they are not
// cache-resident, as in a real layer: by default as many as make each
// format's weights twice the last-level cache (at least 8), or --experts.
// The read bandwidth is measured over a buffer of the same size (at least
// 256 MB). Each format is timed twice: packing B in every call, and with
// each weight packed ahead (a frozen weight's packs are kept across steps).
// Where the kernels read FP8 through lookup tables (bfloat16-pair sets on
// CPUs with AVX-512 VBMI: streamed rows, and the blocked path's packs), those
// rows are timed again through the arithmetic decoder the tables replace
// ("fp8-d"). On avx512_bf16, rows beyond the streamed path are timed again in
// the form of its blocked path this CPU did not choose ("bf16-w"/"fp8-w"
// widened, "-p" bfloat16 pairs). With --blocked, streamed rows are timed
// again on the blocked path ("-b").
//
// Flags: --hidden=2048 --inter=768 --rows=1,16,64,256,1024 --experts=N
// --isa=simd|all|<name> (default simd: every vector set the CPU has; all adds
// the portable kernels) --seconds=0.3 (per measurement; medians of three)
// --blocked.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "experts/int4.h"
#include "experts/kernels/gemm.h"
#include "experts/kernels/internal/bf16_pairs.h"
#include "experts/kernels/internal/fp8_tables.h"
#include "experts/kernels/isa.h"
#include "experts/kernels/row_ops.h"
#include "experts/packed_weights.h"

namespace moefit::experts::kernels {
namespace {

using experts::ExpertWeightOperand;
using experts::Int4Weight;
using experts::QuantizeInt4;

struct Flags {
  int64_t hidden = 2048, inter = 768;
  int64_t experts = 0;  // 0: enough to exceed the caches (ExpertsCycled)
  std::vector<int64_t> rows = {1, 16, 64, 256, 1024};
  std::string isa = "simd";
  double seconds = 0.3;
  bool blocked = false;
};

// Median over three runs of the mean time of fn() over ~seconds.
double TimeIt(const std::function<void()>& fn, double seconds) {
  using Clock = std::chrono::steady_clock;
  fn();  // warm-up (and first-touch of scratch)
  std::vector<double> runs;
  for (int r = 0; r < 3; ++r) {
    int64_t n = 0;
    const auto start = Clock::now();
    double elapsed = 0;
    do {
      fn();
      ++n;
      elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    } while (elapsed < seconds / 3);
    runs.push_back(elapsed / static_cast<double>(n));
  }
  std::sort(runs.begin(), runs.end());
  return runs[1];
}

// Bytes that cycling through cannot keep cached: twice the last-level cache.
int64_t UncachedBytes() {
  return std::max<int64_t>(int64_t{256} << 20, 2 * moefit::experts::kernels::LastLevelCacheBytes());
}

// The group of an int4 weight's scales (Kimi-K2-Thinking's).
constexpr int64_t kInt4Group = 32;

// Bytes a weight element takes in memory, its scales included.
double ElementBytes(ElemType t) {
  switch (t) {
    case ElemType::kF32:
      return 4;
    case ElemType::kBF16:
      return 2;
    case ElemType::kF8E4M3:
      return 1 + 4.0 / (kScaleBlock * kScaleBlock);
    case ElemType::kI4:
      return 0.5 + 2.0 / kInt4Group;
  }
  return 4;
}

// Experts whose weights of type t together exceed UncachedBytes(), or --experts.
int64_t ExpertsCycled(const Flags& f, ElemType t) {
  if (f.experts > 0) return f.experts;
  const auto per_expert = static_cast<int64_t>(3.0 * f.inter * f.hidden * ElementBytes(t));
  return std::max<int64_t>(8, (UncachedBytes() + per_expert - 1) / per_expert);
}

struct Weights {
  ElemType type;
  int64_t experts = 0;
  // [E, 2I, H], [E, H, I]; int4: their bytes [E, 2I, H/2], [E, H, I/2].
  at::Tensor gate_up, down;
  // FP8: float32 block scales; int4: bfloat16 group scales.
  at::Tensor gate_up_scale, down_scale;
};

at::ScalarType TorchType(ElemType t) {
  return t == ElemType::kF32    ? at::kFloat
         : t == ElemType::kBF16 ? at::kBFloat16
                                : at::kFloat8_e4m3fn;
}

Weights MakeWeights(const Flags& f, ElemType type) {
  Weights w{type, ExpertsCycled(f, type)};
  const int64_t n = w.experts;
  if (type == ElemType::kI4) {
    const Int4Weight gate_up = QuantizeInt4(at::randn({n, 2 * f.inter, f.hidden}), kInt4Group);
    const Int4Weight down = QuantizeInt4(at::randn({n, f.hidden, f.inter}), kInt4Group);
    w.gate_up = gate_up.bytes;
    w.gate_up_scale = gate_up.scale;
    w.down = down.bytes;
    w.down_scale = down.scale;
    return w;
  }
  const double s = type == ElemType::kF8E4M3 ? 1.0 : 0.02;
  w.gate_up = (at::randn({n, 2 * f.inter, f.hidden}) * s).to(TorchType(type));
  w.down = (at::randn({n, f.hidden, f.inter}) * s).to(TorchType(type));
  if (type == ElemType::kF8E4M3) {
    auto blocks = [](int64_t n) { return (n + kScaleBlock - 1) / kScaleBlock; };
    w.gate_up_scale = at::full({n, blocks(2 * f.inter), blocks(f.hidden)}, 0.02);
    w.down_scale = at::full({n, blocks(f.hidden), blocks(f.inter)}, 0.02);
  }
  return w;
}

// Expert e's weight [rows, cols] read as B = Wᵀ (transposed) or B = W.
Operand WeightOperand(const at::Tensor& w, const at::Tensor& scale, int64_t e, bool transposed,
                      ElemType type) {
  if (type == ElemType::kI4) {
    return ExpertWeightOperand(w, {scale, at::Tensor(), kInt4Group, 2 * w.size(2)}, e, transposed);
  }
  const int64_t rows = w.size(1), cols = w.size(2);
  Operand op;
  op.type = type;
  op.data = static_cast<const char*>(w.data_ptr()) + e * rows * cols * w.element_size();
  op.row_stride = transposed ? 1 : cols;
  op.col_stride = transposed ? cols : 1;
  if (scale.defined()) {
    const int64_t bc = scale.size(2);
    op.scales = scale.data_ptr<float>() + e * scale.size(1) * bc;
    op.scale_row_stride = transposed ? 1 : bc;
    op.scale_col_stride = transposed ? bc : 1;
  }
  return op;
}

Operand RowMajor(const at::Tensor& t) {
  return Operand{t.data_ptr(), t.scalar_type() == at::kFloat ? ElemType::kF32 : ElemType::kBF16,
                 t.size(1), 1};
}
Operand Transposed(const at::Tensor& t) {
  return Operand{t.data_ptr(), t.scalar_type() == at::kFloat ? ElemType::kF32 : ElemType::kBF16, 1,
                 t.size(1)};
}
Output Out(const at::Tensor& t) { return Output{t.data_ptr(), ElemType::kF32, t.size(1)}; }

// GB/s of one core reading a buffer far larger than the caches: a sum of
// 64-bit words over eight parts of it at once, into eight accumulators, so
// that neither the adds, a dependency chain nor a single stream's prefetch
// limits it, only the reads (the kernels, too, read several weight rows or
// columns at once).
double ReadBandwidth() {
  std::vector<uint64_t> big(UncachedBytes() / 8);
  for (size_t i = 0; i < big.size(); ++i) big[i] = i;
  const size_t part = big.size() / 8;
  volatile uint64_t sink = 0;
  const double t = TimeIt(
      [&] {
        uint64_t acc[8] = {};
        for (size_t i = 0; i < part; ++i) {
          for (size_t j = 0; j < 8; ++j) acc[j] += big[j * part + i];
        }
        sink = sink + acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
      },
      0.5);
  return static_cast<double>(part * 8 * 8) / t / 1e9;
}

const char* TypeName(ElemType t) {
  return t == ElemType::kF32    ? "fp32"
         : t == ElemType::kBF16 ? "bf16"
         : t == ElemType::kI4   ? "int4"
                                : "fp8";
}

Flags Parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* name) -> const char* {
      const size_t n = std::strlen(name);
      return a.compare(0, n, name) == 0 ? argv[i] + n : nullptr;
    };
    if (const char* v = value("--hidden=")) {
      f.hidden = std::atoll(v);
    } else if (const char* v = value("--inter=")) {
      f.inter = std::atoll(v);
    } else if (const char* v = value("--experts=")) {
      f.experts = std::atoll(v);
    } else if (const char* v = value("--isa=")) {
      f.isa = v;
    } else if (const char* v = value("--seconds=")) {
      f.seconds = std::atof(v);
    } else if (a == "--blocked") {
      f.blocked = true;
    } else if (const char* v = value("--rows=")) {
      f.rows.clear();
      for (const char* p = v; *p;) {
        f.rows.push_back(std::atoll(p));
        while (*p && *p != ',') ++p;
        if (*p == ',') ++p;
      }
    } else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      std::exit(2);
    }
  }
  return f;
}

}  // namespace
}  // namespace moefit::experts::kernels

int main(int argc, char** argv) {
  using namespace moefit::experts::kernels;
  const Flags f = Parse(argc, argv);
  at::set_num_threads(1);
  at::manual_seed(0);
  const int64_t H = f.hidden, I = f.inter;
  std::printf(
      "expert_kernel_bench: one core, H %lld, I %lld; experts cycled: fp32 %lld, bf16 "
      "%lld, fp8 %lld, int4 %lld (last-level cache %lld MB)\n",
      static_cast<long long>(H), static_cast<long long>(I),
      static_cast<long long>(ExpertsCycled(f, ElemType::kF32)),
      static_cast<long long>(ExpertsCycled(f, ElemType::kBF16)),
      static_cast<long long>(ExpertsCycled(f, ElemType::kF8E4M3)),
      static_cast<long long>(ExpertsCycled(f, ElemType::kI4)),
      static_cast<long long>(moefit::experts::kernels::LastLevelCacheBytes() >> 20));
  std::printf("CPU flags: %s; detected: %s\n", CpuFlags().c_str(),
              std::string(IsaName(DetectIsa())).c_str());
  const double bw = ReadBandwidth();
  std::printf("read bandwidth (one core, sum over %lld MB): %.1f GB/s\n\n",
              static_cast<long long>(UncachedBytes() >> 20), bw);

  std::vector<Isa> isas;
  for (Isa isa : kAllIsas) {
    if (static_cast<int>(isa) > static_cast<int>(DetectIsa())) continue;
    if (f.isa == "all" || f.isa == IsaName(isa) || (f.isa == "simd" && isa != Isa::kPortable)) {
      isas.push_back(isa);
    }
  }
  const ElemType types[] = {ElemType::kF32, ElemType::kBF16, ElemType::kF8E4M3, ElemType::kI4};
  std::vector<Weights> weights;
  for (ElemType t : types) weights.push_back(MakeWeights(f, t));
  // Float32 weights for the LibTorch ceiling.
  const Weights& w32 = weights[0];

  // Each rows count's buffers and its LibTorch float32 time: the same four
  // GEMMs per expert, one thread.
  struct Rows {
    int64_t m;
    at::Tensor x, dy, gu, h, dgu, dh, dx, dwgu, dwd;
    double t_mm = 0;
  };
  std::vector<Rows> rows;
  for (int64_t m : f.rows) {
    Rows r{m,
           at::randn({m, H}),
           at::randn({m, H}),
           at::empty({m, 2 * I}),
           at::randn({m, I}),
           at::randn({m, 2 * I}),
           at::empty({m, I}),
           at::empty({m, H}),
           at::empty({2 * I, H}),
           at::empty({H, I})};
    int64_t e_ref = 0;
    r.t_mm = TimeIt(
        [&] {
          const int64_t e = e_ref++ % w32.experts;
          at::mm_out(r.gu, r.x, w32.gate_up[e].t());
          at::mm_out(r.dx, r.h, w32.down[e].t());
          at::mm_out(r.dh, r.dy, w32.down[e]);
          at::mm_out(r.dx, r.dgu, w32.gate_up[e]);
        },
        f.seconds);
    rows.push_back(std::move(r));
  }
  // Lines of the table by (rows, isa, format), timed isa by isa and format
  // by format so that each weight's packs are made once for all rows counts.
  std::vector<std::vector<std::string>> lines(rows.size());
  for (Isa isa : isas) {
    for (const Weights& w : weights) {
      // The packs of as many experts as exceed the caches (float32, bfloat16
      // pairs, or an FP8 weight's bytes on the pairs kernels), at most all
      // of them.
      const int64_t pack_bytes = PackedB::Bytes(isa, ElemType::kF32, H, 2 * I, w.type) +
                                 PackedB::Bytes(isa, ElemType::kF32, I, H, w.type) +
                                 PackedB::Bytes(isa, ElemType::kF32, H, I, w.type) +
                                 PackedB::Bytes(isa, ElemType::kF32, 2 * I, H, w.type);
      const int64_t num_kept =
          f.experts > 0
              ? f.experts
              : std::min(w.experts,
                         std::max<int64_t>(8, (UncachedBytes() + pack_bytes - 1) / pack_bytes));
      std::vector<PackedB> kept;
      for (int64_t e = 0; e < num_kept; ++e) {
        kept.emplace_back(isa, ElemType::kF32, H, 2 * I,
                          WeightOperand(w.gate_up, w.gate_up_scale, e, true, w.type));
        kept.emplace_back(isa, ElemType::kF32, I, H,
                          WeightOperand(w.down, w.down_scale, e, true, w.type));
        kept.emplace_back(isa, ElemType::kF32, H, I,
                          WeightOperand(w.down, w.down_scale, e, false, w.type));
        kept.emplace_back(isa, ElemType::kF32, 2 * I, H,
                          WeightOperand(w.gate_up, w.gate_up_scale, e, false, w.type));
      }
      for (size_t ri = 0; ri < rows.size(); ++ri) {
        Rows& r = rows[ri];
        const int64_t m = r.m;
        int64_t e_run = 0;
        auto fwd_dx = [&](int64_t e, RowPath path = RowPath::kAuto) {
          Gemm(isa, m, 2 * I, H, RowMajor(r.x),
               WeightOperand(w.gate_up, w.gate_up_scale, e, true, w.type), Out(r.gu), false, path);
          Gemm(isa, m, H, I, RowMajor(r.h), WeightOperand(w.down, w.down_scale, e, true, w.type),
               Out(r.dx), false, path);
          Gemm(isa, m, I, H, RowMajor(r.dy), WeightOperand(w.down, w.down_scale, e, false, w.type),
               Out(r.dh), false, path);
          Gemm(isa, m, H, 2 * I, RowMajor(r.dgu),
               WeightOperand(w.gate_up, w.gate_up_scale, e, false, w.type), Out(r.dx), false, path);
        };
        const double t = TimeIt([&] { fwd_dx(e_run++ % w.experts); }, f.seconds);
        // The same with each weight packed ahead (PackedB), as the expert
        // layer keeps the packs of a frozen weight from one step to the next.
        auto fwd_dx_kept = [&](RowPath path = RowPath::kAuto) {
          const PackedB* p = &kept[4 * (e_run++ % num_kept)];
          Gemm(isa, m, RowMajor(r.x), p[0], Out(r.gu), false, path);
          Gemm(isa, m, RowMajor(r.h), p[1], Out(r.dx), false, path);
          Gemm(isa, m, RowMajor(r.dy), p[2], Out(r.dh), false, path);
          Gemm(isa, m, RowMajor(r.dgu), p[3], Out(r.dx), false, path);
        };
        const double t_kept = TimeIt([&] { fwd_dx_kept(); }, f.seconds);
        // Rows the layer streams, timed again on the blocked path (packing
        // per call, and packed ahead): where one overtakes the other.
        const bool also_blocked = f.blocked && m <= kMaxStreamedRows;
        double t_blocked = 0, t_blocked_kept = 0;
        if (also_blocked) {
          t_blocked = TimeIt([&] { fwd_dx(e_run++ % w.experts, RowPath::kBlocked); }, f.seconds);
          t_blocked_kept = TimeIt([&] { fwd_dx_kept(RowPath::kBlocked); }, f.seconds);
        }
        // FP8 rows through the lookup tables (streamed, or packed per call and
        // expanded from kept packs on the bfloat16-pairs kernels): the
        // arithmetic decoder they replace, timed in the same run as their
        // baseline.
        const bool fp8_tables =
            w.type == ElemType::kF8E4M3 && MultipliesInBf16(isa) && internal::Fp8TablesUsable();
        const bool tables = fp8_tables && (m <= std::max(internal::Fp8TableRows().k_contiguous,
                                                         internal::Fp8TableRows().n_contiguous) ||
                                           (m > kMaxStreamedRows && MultipliesBf16Pairs(isa)));
        double t_decoder = 0, t_decoder_kept = 0;
        if (tables) {
          internal::SetFp8TablesEnabled(false);
          t_decoder = TimeIt([&] { fwd_dx(e_run++ % w.experts); }, f.seconds);
          t_decoder_kept = TimeIt([&] { fwd_dx_kept(); }, f.seconds);
          internal::SetFp8TablesEnabled(true);
        }
        // avx512_bf16's blocked path in the form this CPU did not choose
        // (bfloat16 pairs or widened to float32, isa.h), packing per call.
        const bool chosen_pairs = MultipliesBf16Pairs(isa);
        const bool other_form =
            isa == Isa::kAvx512Bf16 && w.type != ElemType::kF32 && m > kMaxStreamedRows;
        double t_other = 0;
        if (other_form) {
          internal::SetBf16Pairs(!chosen_pairs);
          t_other = TimeIt([&] { fwd_dx(e_run++ % w.experts); }, f.seconds);
          internal::SetBf16Pairs(std::nullopt);
        }
        double t_dw = 0;
        if (!WeightOnly(w.type)) {  // FP8 and int4 weights are frozen: no weight gradients
          t_dw = TimeIt(
              [&] {
                Gemm(isa, 2 * I, H, m, Transposed(r.dgu), RowMajor(r.x), Out(r.dwgu), false);
                Gemm(isa, H, I, m, Transposed(r.dy), RowMajor(r.h), Out(r.dwd), false);
              },
              f.seconds);
        }
        const double flops = 2.0 * 2 * (m * 2 * I * H + m * H * I);
        // Forward + dX read each weight (and its scales) twice.
        const double bytes = 2.0 * (3.0 * I * H) * ElementBytes(w.type);
        const double floor_ms = bytes / (bw * 1e9) * 1e3;
        auto add_line = [&](const std::string& type, double t_run, double t_run_kept) {
          char line[256];
          const int used = std::snprintf(
              line, sizeof(line), "%-12s %-6s %6lld %10.3f %10.3f %9.1f %9.2f %12.3f %8.2f",
              std::string(IsaName(isa)).c_str(), type.c_str(), static_cast<long long>(m),
              t_run * 1e3, t_dw * 1e3, flops / t_run / 1e9, r.t_mm / t_run, floor_ms,
              floor_ms / (t_run * 1e3));
          if (t_run_kept > 0) {
            std::snprintf(line + used, sizeof(line) - used, " %9.3f %9.2f\n", t_run_kept * 1e3,
                          floor_ms / (t_run_kept * 1e3));
          } else {
            std::snprintf(line + used, sizeof(line) - used, " %9s %9s\n", "-", "-");
          }
          lines[ri].push_back(line);
        };
        add_line(TypeName(w.type), t, t_kept);
        if (tables) add_line("fp8-d", t_decoder, t_decoder_kept);
        if (also_blocked) {
          add_line(std::string(TypeName(w.type)) + "-b", t_blocked, t_blocked_kept);
        }
        if (other_form) {
          add_line(std::string(TypeName(w.type)) + (chosen_pairs ? "-w" : "-p"), t_other, 0);
        }
      }
    }
  }
  std::printf("%-12s %-6s %6s %10s %10s %9s %9s %12s %8s %9s %9s\n", "isa", "dtype", "rows",
              "fwd+dX ms", "+dW ms", "GFLOP/s", "vs mm", "mem floor ms", "vs mem", "kept ms",
              "kept/mem");
  for (size_t ri = 0; ri < rows.size(); ++ri) {
    for (const std::string& line : lines[ri]) std::fputs(line.c_str(), stdout);
    const Rows& r = rows[ri];
    const double flops = 2.0 * 2 * (r.m * 2 * I * H + r.m * H * I);
    std::printf("%-12s %-6s %6lld %10.3f %10s %9.1f %9s\n\n", "libtorch mm", "fp32",
                static_cast<long long>(r.m), r.t_mm * 1e3, "", flops / r.t_mm / 1e9, "1.00");
  }
  std::printf(
      "vs mm: LibTorch fp32 time / kernel time for forward+dX (higher is better);\n"
      "vs mem: the time to stream the weights once per GEMM at the measured bandwidth /\n"
      "kernel time (1.0 = at the memory floor);\n"
      "kept ms, kept/mem: forward+dX with the weights packed ahead (as a frozen weight's\n"
      "packs are kept across steps; up to 8 rows stream the weight unpacked either way),\n"
      "and its ratio to the same memory floor.\n"
      "fp8-d: the FP8 rows above them again, through the arithmetic decoder instead of\n"
      "the per-block lookup tables (AVX-512 VBMI; the same bits), which stream the\n"
      "forward GEMMs up to %lld rows and the dX ones up to %lld here (measured), and\n"
      "on bfloat16-pair kernels pack the weight per call and expand kept packs.\n"
      "fp8-b, bf16-b, fp32-b (--blocked): the streamed rows above them again on the\n"
      "blocked path, packing per call and (kept) packed ahead.\n"
      "bf16-w, fp8-w (bf16-p, fp8-p): on avx512_bf16, the rows above them again with the\n"
      "weights widened to float32 (multiplied as bfloat16 pairs), the form this CPU did not\n"
      "choose (%s), packing per call.\n",
      static_cast<long long>(internal::Fp8TableRows().k_contiguous),
      static_cast<long long>(internal::Fp8TableRows().n_contiguous),
      IsaDescription(Isa::kAvx512Bf16).c_str());
  return 0;
}
