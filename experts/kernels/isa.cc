// Run-time instruction-set selection; see isa.h.
#include "experts/kernels/isa.h"

#include <c10/util/Exception.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

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
  if (isa != Isa::kAvx512Bf16) return out;
  char speed[96];
  std::snprintf(speed, sizeof speed, "vdpbf16ps at %.2fx the FMA's multiply-adds per second",
                Bf16PairSpeed());
  return out +
         (MultipliesBf16Pairs(isa) ? " (bfloat16 pairs: " : " (weights widened to float32: ") +
         speed + ")";
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

void SetBf16Pairs(std::optional<bool> pairs) {
  bf16_pairs_forced.store(pairs.has_value() ? static_cast<int>(*pairs) : -1);
}

}  // namespace internal
}  // namespace moefit::experts::kernels
