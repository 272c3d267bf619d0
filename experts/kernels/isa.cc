// Run-time instruction-set selection; see isa.h.
#include "experts/kernels/isa.h"

#include <c10/util/Exception.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

#include "experts/kernels/gemm.h"
#include "experts/kernels/internal/bf16_pairs.h"
#include "experts/kernels/internal/fp8_tables.h"

namespace moefit::experts::kernels {
namespace {

// Linux keeps AMX's 8 KiB tile data out of a process's saved state until the
// process asks for it (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); without
// that, the first tile instruction kills the process. Asked once, for every
// thread of the process; an older kernel or a sandbox that refuses it leaves
// the CPU at avx512_bf16.
bool TileStatePermitted() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// libgcc's CPU probe checks both CPUID and that the OS saves the wider
// registers (XGETBV), so a flag here is usable, not only present.
Isa Detect() {
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return Isa::kPortable;
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))) {
    return Isa::kAvx2;
  }
  if (!__builtin_cpu_supports("avx512bf16")) return Isa::kAvx512;
  if (!(__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16")) ||
      !TileStatePermitted()) {
    return Isa::kAvx512Bf16;
  }
  return Isa::kAmxBf16;
}

std::string KnownNames() {
  std::string names;
  for (Isa isa : kAllIsas) {
    if (!names.empty()) names += ", ";
    names += IsaName(isa);
  }
  return names;
}

// The environment's limit, read once.
Isa FromEnvironment(Isa detected) {
  const char* value = std::getenv("MOEFIT_CPU_ISA");
  if (value == nullptr || value[0] == '\0') return detected;
  for (Isa isa : kAllIsas) {
    if (IsaName(isa) == value) {
      TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(detected), "MOEFIT_CPU_ISA=", value,
                  ": this CPU supports at most ", IsaName(detected), " (", CpuFlags(), ")");
      return isa;
    }
  }
  TORCH_CHECK(false, "MOEFIT_CPU_ISA=", value, " is not an instruction set (known: ", KnownNames(),
              ")");
}

std::atomic<int> limit{-1};  // -1: not set by LimitIsa
std::atomic<bool> fp8_tables_enabled{true};
std::atomic<int> bf16_pairs_forced{-1};  // -1: measured; else 0 / 1 (SetBf16Pairs)
// -1: measured; else k_contiguous * 256 + n_contiguous (SetFp8TableRows).
std::atomic<int64_t> fp8_table_rows_forced{-1};

}  // namespace

std::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kPortable:
      return "portable";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
    case Isa::kAmxBf16:
      return "amx_bf16";
  }
  return "?";
}

Isa DetectIsa() {
  static const Isa detected = Detect();
  return detected;
}

Isa ActiveIsa() {
  static const Isa from_env = FromEnvironment(DetectIsa());
  const int l = limit.load(std::memory_order_relaxed);
  if (l >= 0 && l < static_cast<int>(from_env)) return static_cast<Isa>(l);
  return from_env;
}

void LimitIsa(Isa isa) {
  const Isa detected = DetectIsa();
  limit.store(static_cast<int>(isa) < static_cast<int>(detected) ? static_cast<int>(isa)
                                                                 : static_cast<int>(detected));
}

double Bf16PairSpeed() {
  static const double speed = static_cast<int>(DetectIsa()) >= static_cast<int>(Isa::kAvx512Bf16)
                                  ? internal::MeasureBf16PairSpeed()
                                  : 0.0;
  return speed;
}

bool MultipliesBf16Pairs(Isa isa) {
  if (isa == Isa::kAmxBf16) return true;
  if (isa != Isa::kAvx512Bf16) return false;
  const int forced = bf16_pairs_forced.load(std::memory_order_relaxed);
  return forced >= 0 ? forced == 1 : Bf16PairSpeed() > 1.0;
}

std::string IsaDescription(Isa isa) {
  std::string out(IsaName(isa));
  if (isa == Isa::kAvx512Bf16) {
    char speed[96];
    std::snprintf(speed, sizeof speed, "vdpbf16ps at %.2fx the FMA's multiply-adds per second",
                  Bf16PairSpeed());
    out += std::string(MultipliesBf16Pairs(isa) ? " (bfloat16 pairs: "
                                                : " (weights widened to float32: ") +
           speed + ")";
  }
  if (MultipliesInBf16(isa) && internal::Fp8TablesUsable()) {
    const internal::Fp8TableRowLimits rows = internal::Fp8TableRows();
    char tables[128];
    std::snprintf(
        tables, sizeof tables, "; FP8 lookup tables up to %lld rows in forward GEMMs, %lld in dX",
        static_cast<long long>(rows.k_contiguous), static_cast<long long>(rows.n_contiguous));
    out += tables;
  }
  return out;
}

std::string CpuFlags() {
  __builtin_cpu_init();
  std::string flags;
  auto add = [&](bool present, const char* name) {
    if (!present) return;
    if (!flags.empty()) flags += ' ';
    flags += name;
  };
  add(__builtin_cpu_supports("avx2"), "avx2");
  add(__builtin_cpu_supports("fma"), "fma");
  add(__builtin_cpu_supports("avx512f"), "avx512f");
  add(__builtin_cpu_supports("avx512bw"), "avx512bw");
  add(__builtin_cpu_supports("avx512vl"), "avx512vl");
  add(__builtin_cpu_supports("avx512bf16"), "avx512_bf16");
  add(__builtin_cpu_supports("avx512vbmi"), "avx512_vbmi");
  flags += __builtin_cpu_supports("amx-bf16")
               ? (DetectIsa() == Isa::kAmxBf16 ? " amx_bf16" : " amx_bf16 (refused by the OS)")
               : " (no amx)";
  return flags;
}

namespace internal {

bool Fp8TablesUsable() {
  static const bool cpu = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi");
  }();
  return cpu && fp8_tables_enabled.load(std::memory_order_relaxed);
}

void SetFp8TablesEnabled(bool enabled) { fp8_tables_enabled.store(enabled); }

Fp8TableRowLimits MeasureFp8TableRows(Isa isa) {
  constexpr int64_t k = 1024, n = 512, kBlocks = k / kScaleBlock, nBlocks = n / kScaleBlock;
  std::vector<uint8_t> bytes(k * n);
  for (size_t i = 0; i < bytes.size(); ++i) {
    const auto v = static_cast<uint8_t>((i * 37 + 11) % 256);
    bytes[i] = (v & 0x7f) == 0x7f ? 0x42 : v;  // no NaN
  }
  const std::vector<float> scales(kBlocks * nBlocks, 0.01f);
  std::vector<float> a(kFp8TableMaxRows * k), c(kFp8TableMaxRows * n);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i % 7) * 0.25f - 0.75f;
  // B(kk, j) = bytes[j * k + kk] (Wᵀ) or bytes[kk * n + j] (W).
  const Operand k_contiguous{bytes.data(), ElemType::kF8E4M3, 1, k, scales.data(), 1, kBlocks};
  const Operand n_contiguous{bytes.data(), ElemType::kF8E4M3, n, 1, scales.data(), nBlocks, 1};
  // The tables may take every row count meanwhile; the switch and the held
  // limits are put back after.
  const bool enabled = fp8_tables_enabled.load();
  const int64_t forced = fp8_table_rows_forced.exchange(kFp8TableMaxRows * 256 + kFp8TableMaxRows);
  auto seconds = [&](const Operand& b, int64_t m, bool tables) {
    fp8_tables_enabled.store(tables);
    const auto start = std::chrono::steady_clock::now();
    Gemm(isa, m, n, k, Operand{a.data(), ElemType::kF32, k, 1}, b,
         Output{c.data(), ElemType::kF32, n}, false, RowPath::kStreamed);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  auto limit = [&](const Operand& b) {
    int64_t rows = 0;
    for (int64_t m = 1; m <= kFp8TableMaxRows; ++m) {
      seconds(b, m, true);
      seconds(b, m, false);
      double tables = std::numeric_limits<double>::infinity(), decoder = tables;
      for (int round = 0; round < 5; ++round) {
        tables = std::min(tables, seconds(b, m, true));
        decoder = std::min(decoder, seconds(b, m, false));
      }
      if (tables >= decoder) break;
      rows = m;
    }
    return rows;
  };
  const Fp8TableRowLimits limits{limit(k_contiguous), limit(n_contiguous)};
  fp8_tables_enabled.store(enabled);
  fp8_table_rows_forced.store(forced);
  return limits;
}

Fp8TableRowLimits Fp8TableRows() {
  const int64_t forced = fp8_table_rows_forced.load(std::memory_order_relaxed);
  if (forced >= 0) return {forced / 256, forced % 256};
  static const Fp8TableRowLimits measured =
      Fp8TablesUsable() && static_cast<int>(DetectIsa()) >= static_cast<int>(Isa::kAvx512Bf16)
          ? MeasureFp8TableRows(Isa::kAvx512Bf16)
          : Fp8TableRowLimits{};
  return measured;
}

void SetFp8TableRows(std::optional<Fp8TableRowLimits> limits) {
  fp8_table_rows_forced.store(limits.has_value() ? limits->k_contiguous * 256 + limits->n_contiguous
                                                 : int64_t{-1});
}

void SetBf16Pairs(std::optional<bool> pairs) {
  bf16_pairs_forced.store(pairs.has_value() ? static_cast<int>(*pairs) : -1);
}

}  // namespace internal
}  // namespace moefit::experts::kernels
