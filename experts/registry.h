// The explicit registry of expert backends: names -> factories, filled in one
// place (registry.cc) rather than by static initializers a linker may drop.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "experts/expert_backend.h"

namespace moefit::experts {

// Names of every registered backend, in registration order.
std::vector<std::string> ExpertBackendNames();

// Creates the backend registered under `name`; NotFound lists the known names.
absl::StatusOr<std::unique_ptr<ExpertBackend>> CreateExpertBackend(std::string_view name,
                                                                   const BackendOptions& options);

}  // namespace moefit::experts
