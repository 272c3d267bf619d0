// Run-time instruction-set selection; see isa.h.
#include "experts/kernels/isa.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>

namespace moefit::experts::kernels {
namespace {

constexpr Isa kAll[] = {Isa::kPortable, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16};

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
  return Isa::kAvx512Bf16;
}

std::string KnownNames() {
  std::string names;
  for (Isa isa : kAll) {
    if (!names.empty()) names += ", ";
    names += IsaName(isa);
  }
  return names;
}

// The environment's limit, read once.
Isa FromEnvironment(Isa detected) {
  const char* value = std::getenv("MOEFIT_CPU_ISA");
  if (value == nullptr || value[0] == '\0') return detected;
  for (Isa isa : kAll) {
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
  flags += __builtin_cpu_supports("amx-bf16") ? " amx_bf16" : " (no amx)";
  return flags;
}

}  // namespace moefit::experts::kernels
