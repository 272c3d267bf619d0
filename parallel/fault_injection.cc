// Test-only fault injection; see fault_injection.h.
#include "parallel/fault_injection.h"

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace moefit::parallel {
namespace {

constexpr char kGrammar[] =
    "expected stall:rank=R:step=S, crash:rank=R:step=S or slow:rank=R:ms=M[:step=S], each "
    "optionally with :layer=L or :at=save";

// The fault armed for this process, if any: written once at start-up, before
// any step runs, and read by the thread that runs the steps.
std::optional<FaultSpec>& Armed() {
  static std::optional<FaultSpec> armed;
  return armed;
}

absl::Status Invalid(absl::string_view spec, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("fault spec '", spec, "': ", why, " (", kGrammar, ")"));
}

void Announce(const FaultSpec& fault, absl::string_view what, int64_t step) {
  const std::string where = fault.in_save      ? std::string(" in the checkpoint save")
                            : fault.layer >= 0 ? absl::StrCat(" in layer ", fault.layer)
                                               : std::string();
  std::fprintf(stderr, "moefit: MOEFIT_FAULT: rank %d %s at step %lld%s (unix time %lld)\n",
               fault.rank, std::string(what).c_str(), static_cast<long long>(step), where.c_str(),
               static_cast<long long>(absl::ToUnixSeconds(absl::Now())));
  std::fflush(stderr);
}

void Inject(const FaultSpec& fault, int64_t step) {
  switch (fault.kind) {
    case FaultSpec::Kind::kStall:
      Announce(fault, "stalls", step);
      while (true) absl::SleepFor(absl::Hours(1));
    case FaultSpec::Kind::kCrash:
      Announce(fault, "crashes (SIGKILL)", step);
      std::raise(SIGKILL);
      std::_Exit(137);  // not reached
    case FaultSpec::Kind::kSlow: {
      static bool announced = false;
      if (!announced) {
        const char* every = fault.in_save ? " per save, starting" : " per step, starting";
        Announce(fault, absl::StrCat("sleeps ", fault.ms, " ms", fault.step == 0 ? every : ""),
                 step);
      }
      announced = true;
      absl::SleepFor(absl::Milliseconds(fault.ms));
      return;
    }
  }
}

bool Due(const FaultSpec& fault, int64_t step) { return fault.step == 0 || fault.step == step; }

}  // namespace

absl::StatusOr<FaultSpec> ParseFaultSpec(absl::string_view spec) {
  const std::vector<absl::string_view> parts = absl::StrSplit(spec, ':');
  FaultSpec fault;
  if (parts[0] == "stall") {
    fault.kind = FaultSpec::Kind::kStall;
  } else if (parts[0] == "crash") {
    fault.kind = FaultSpec::Kind::kCrash;
  } else if (parts[0] == "slow") {
    fault.kind = FaultSpec::Kind::kSlow;
  } else {
    return Invalid(spec, absl::StrCat("unknown kind '", parts[0], "'"));
  }
  std::set<absl::string_view> seen;
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::vector<absl::string_view> key_value =
        absl::StrSplit(parts[i], absl::MaxSplits('=', 1));
    if (key_value.size() != 2)
      return Invalid(spec, absl::StrCat("'", parts[i], "' is not key=value"));
    const absl::string_view key = key_value[0];
    const absl::string_view value = key_value[1];
    if (!seen.insert(key).second) return Invalid(spec, absl::StrCat("'", key, "' given twice"));
    if (key == "at") {
      if (value != "save") return Invalid(spec, absl::StrCat("at = '", value, "': only 'save'"));
      fault.in_save = true;
      continue;
    }
    int64_t number = 0;
    if (!absl::SimpleAtoi(value, &number)) {
      return Invalid(spec, absl::StrCat(key, " = '", value, "' is not an integer"));
    }
    if (key == "rank") {
      if (number < 0 || number > INT32_MAX) return Invalid(spec, "rank must be >= 0");
      fault.rank = static_cast<int>(number);
    } else if (key == "step") {
      if (number < 1) return Invalid(spec, "step must be >= 1 (steps count from 1)");
      fault.step = number;
    } else if (key == "layer") {
      if (number < 0) return Invalid(spec, "layer must be >= 0");
      fault.layer = number;
    } else if (key == "ms" && fault.kind == FaultSpec::Kind::kSlow) {
      if (number < 1) return Invalid(spec, "ms must be >= 1");
      fault.ms = number;
    } else {
      return Invalid(spec, absl::StrCat("unknown key '", key, "' for ", parts[0]));
    }
  }
  if (!seen.count("rank")) return Invalid(spec, "rank is missing");
  if (fault.in_save && fault.layer >= 0)
    return Invalid(spec, "layer and at=save exclude each other");
  if (fault.kind == FaultSpec::Kind::kSlow) {
    if (!seen.count("ms")) return Invalid(spec, "ms is missing");
  } else if (!seen.count("step")) {
    return Invalid(spec, "step is missing");
  }
  return fault;
}

absl::Status InstallFaultFromEnvironment(int world_rank) {
  const char* value = std::getenv("MOEFIT_FAULT");
  Armed().reset();
  if (value == nullptr || *value == '\0') return absl::OkStatus();
  absl::StatusOr<FaultSpec> fault = ParseFaultSpec(value);
  if (!fault.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("MOEFIT_FAULT: ", fault.status().message()));
  }
  if (fault->rank == world_rank) Armed() = *fault;
  return absl::OkStatus();
}

void MaybeInjectFault(int64_t step, int64_t layer) {
  const std::optional<FaultSpec>& fault = Armed();
  if (!fault.has_value() || fault->in_save || !Due(*fault, step) || fault->layer != layer) return;
  Inject(*fault, step);
}

void MaybeInjectFaultInSave(int64_t steps_done) {
  const std::optional<FaultSpec>& fault = Armed();
  if (!fault.has_value() || !fault->in_save || !Due(*fault, steps_done)) return;
  Inject(*fault, steps_done);
}

}  // namespace moefit::parallel
