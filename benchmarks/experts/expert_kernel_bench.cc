// moefit's expert GEMM (experts/kernels/gemm.h) on one core, per instruction
// set and weight format, against two ceilings measured in the same run:
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
// pass cycles through --experts distinct weights so that they are not
// cache-resident, as in a real layer. Each format is timed twice: packing B
// in every call, and with each weight packed ahead (a frozen weight's packs
// are kept across steps).
//
// Flags: --hidden=2048 --inter=768 --rows=1,16,64,256,1024 --experts=8
// --isa=simd|all|<name> (default simd: every vector set the CPU has; all adds
// the portable kernels) --seconds=0.3 (per measurement; medians of three).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "experts/kernels/gemm.h"
#include "experts/kernels/isa.h"

namespace moefit::experts::kernels {
namespace {

struct Flags {
  int64_t hidden = 2048, inter = 768, experts = 8;
  std::vector<int64_t> rows = {1, 16, 64, 256, 1024};
  std::string isa = "simd";
  double seconds = 0.3;
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

struct Weights {
  ElemType type;
  at::Tensor gate_up, down;              // [E, 2I, H], [E, H, I]
  at::Tensor gate_up_scale, down_scale;  // FP8 only
};

at::ScalarType TorchType(ElemType t) {
  return t == ElemType::kF32    ? at::kFloat
         : t == ElemType::kBF16 ? at::kBFloat16
                                : at::kFloat8_e4m3fn;
}

Weights MakeWeights(const Flags& f, ElemType type) {
  Weights w{type};
  const double s = type == ElemType::kF8E4M3 ? 1.0 : 0.02;
  w.gate_up = (at::randn({f.experts, 2 * f.inter, f.hidden}) * s).to(TorchType(type));
  w.down = (at::randn({f.experts, f.hidden, f.inter}) * s).to(TorchType(type));
  if (type == ElemType::kF8E4M3) {
    auto blocks = [](int64_t n) { return (n + kScaleBlock - 1) / kScaleBlock; };
    w.gate_up_scale = at::full({f.experts, blocks(2 * f.inter), blocks(f.hidden)}, 0.02);
    w.down_scale = at::full({f.experts, blocks(f.hidden), blocks(f.inter)}, 0.02);
  }
  return w;
}

// Expert e's weight [rows, cols] read as B = Wᵀ (transposed) or B = W.
Operand WeightOperand(const at::Tensor& w, const at::Tensor& scale, int64_t e, bool transposed,
                      ElemType type) {
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

// GB/s of a sum over a buffer far larger than the caches.
double ReadBandwidth() {
  at::Tensor big = at::ones({64 << 20}, at::kFloat);  // 256 MB
  const double t = TimeIt([&] { (void)big.sum().item<float>(); }, 0.5);
  return static_cast<double>(big.numel() * 4) / t / 1e9;
}

const char* TypeName(ElemType t) {
  return t == ElemType::kF32 ? "fp32" : t == ElemType::kBF16 ? "bf16" : "fp8";
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
  std::printf("expert_kernel_bench: one core, H %lld, I %lld, %lld experts cycled\n",
              static_cast<long long>(H), static_cast<long long>(I),
              static_cast<long long>(f.experts));
  std::printf("CPU flags: %s; detected: %s\n", CpuFlags().c_str(),
              std::string(IsaName(DetectIsa())).c_str());
  const double bw = ReadBandwidth();
  std::printf("read bandwidth (one core, sum over 256 MB): %.1f GB/s\n\n", bw);

  std::vector<Isa> isas;
  for (Isa isa : kAllIsas) {
    if (static_cast<int>(isa) > static_cast<int>(DetectIsa())) continue;
    if (f.isa == "all" || f.isa == IsaName(isa) || (f.isa == "simd" && isa != Isa::kPortable)) {
      isas.push_back(isa);
    }
  }
  const ElemType types[] = {ElemType::kF32, ElemType::kBF16, ElemType::kF8E4M3};
  std::vector<Weights> weights;
  for (ElemType t : types) weights.push_back(MakeWeights(f, t));
  // Float32 weights for the LibTorch ceiling.
  const Weights& w32 = weights[0];

  std::printf("%-12s %-5s %6s %10s %10s %9s %9s %12s %8s %9s %9s\n", "isa", "dtype", "rows",
              "fwd+dX ms", "+dW ms", "GFLOP/s", "vs mm", "mem floor ms", "vs mem", "kept ms",
              "kept/mem");
  for (int64_t m : f.rows) {
    at::Tensor x = at::randn({m, H}), dy = at::randn({m, H});
    at::Tensor gu = at::empty({m, 2 * I}), h = at::randn({m, I}), dgu = at::randn({m, 2 * I});
    at::Tensor dh = at::empty({m, I}), dx = at::empty({m, H});
    at::Tensor dwgu = at::empty({2 * I, H}), dwd = at::empty({H, I});
    // LibTorch fp32: the same four GEMMs per expert, one thread.
    int64_t e_ref = 0;
    const double t_mm = TimeIt(
        [&] {
          const int64_t e = e_ref++ % f.experts;
          at::mm_out(gu, x, w32.gate_up[e].t());
          at::mm_out(dx, h, w32.down[e].t());
          at::mm_out(dh, dy, w32.down[e]);
          at::mm_out(dx, dgu, w32.gate_up[e]);
        },
        f.seconds);
    const double flops = 2.0 * 2 * (m * 2 * I * H + m * H * I);
    for (Isa isa : isas) {
      for (const Weights& w : weights) {
        int64_t e_run = 0;
        auto fwd_dx = [&](int64_t e) {
          Gemm(isa, m, 2 * I, H, RowMajor(x),
               WeightOperand(w.gate_up, w.gate_up_scale, e, true, w.type), Out(gu), false);
          Gemm(isa, m, H, I, RowMajor(h), WeightOperand(w.down, w.down_scale, e, true, w.type),
               Out(dx), false);
          Gemm(isa, m, I, H, RowMajor(dy), WeightOperand(w.down, w.down_scale, e, false, w.type),
               Out(dh), false);
          Gemm(isa, m, H, 2 * I, RowMajor(dgu),
               WeightOperand(w.gate_up, w.gate_up_scale, e, false, w.type), Out(dx), false);
        };
        const double t = TimeIt([&] { fwd_dx(e_run++ % f.experts); }, f.seconds);
        // The same with each weight packed ahead (PackedB), as the expert
        // layer keeps the packs of a frozen weight from one step to the next.
        std::vector<PackedB> kept;
        for (int64_t e = 0; e < f.experts; ++e) {
          kept.emplace_back(isa, ElemType::kF32, H, 2 * I,
                            WeightOperand(w.gate_up, w.gate_up_scale, e, true, w.type));
          kept.emplace_back(isa, ElemType::kF32, I, H,
                            WeightOperand(w.down, w.down_scale, e, true, w.type));
          kept.emplace_back(isa, ElemType::kF32, H, I,
                            WeightOperand(w.down, w.down_scale, e, false, w.type));
          kept.emplace_back(isa, ElemType::kF32, 2 * I, H,
                            WeightOperand(w.gate_up, w.gate_up_scale, e, false, w.type));
        }
        const double t_kept = TimeIt(
            [&] {
              const PackedB* p = &kept[4 * (e_run++ % f.experts)];
              Gemm(isa, m, RowMajor(x), p[0], Out(gu), false);
              Gemm(isa, m, RowMajor(h), p[1], Out(dx), false);
              Gemm(isa, m, RowMajor(dy), p[2], Out(dh), false);
              Gemm(isa, m, RowMajor(dgu), p[3], Out(dx), false);
            },
            f.seconds);
        kept.clear();
        double t_dw = 0;
        if (w.type != ElemType::kF8E4M3) {  // FP8 weights are frozen: no weight gradients
          t_dw = TimeIt(
              [&] {
                Gemm(isa, 2 * I, H, m, Transposed(dgu), RowMajor(x), Out(dwgu), false);
                Gemm(isa, H, I, m, Transposed(dy), RowMajor(h), Out(dwd), false);
              },
              f.seconds);
        }
        // Forward + dX read each weight twice.
        const double bytes = 2.0 * (3.0 * I * H) * w.gate_up.element_size();
        const double floor_ms = bytes / (bw * 1e9) * 1e3;
        std::printf("%-12s %-5s %6lld %10.3f %10.3f %9.1f %9.2f %12.3f %8.2f %9.3f %9.2f\n",
                    std::string(IsaName(isa)).c_str(), TypeName(w.type), static_cast<long long>(m),
                    t * 1e3, t_dw * 1e3, flops / t / 1e9, t_mm / t, floor_ms, floor_ms / (t * 1e3),
                    t_kept * 1e3, floor_ms / (t_kept * 1e3));
      }
    }
    std::printf("%-12s %-5s %6lld %10.3f %10s %9.1f %9s\n\n", "libtorch mm", "fp32",
                static_cast<long long>(m), t_mm * 1e3, "", flops / t_mm / 1e9, "1.00");
  }
  std::printf(
      "vs mm: LibTorch fp32 time / kernel time for forward+dX (higher is better);\n"
      "vs mem: the time to stream the weights once per GEMM at the measured bandwidth /\n"
      "kernel time (1.0 = at the memory floor);\n"
      "kept ms, kept/mem: forward+dX with the weights packed ahead (as a frozen weight's\n"
      "packs are kept across steps; up to 8 rows stream the weight unpacked either way),\n"
      "and its ratio to the same memory floor.\n");
  return 0;
}
