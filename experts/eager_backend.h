// `eager`: the reference expert backend. A plain loop over experts with one
// ATen matmul per projection and the textbook SwiGLU derivative; slow on many
// small experts, but obviously correct, and what every fast backend is tested
// against.
#pragma once

#include <memory>

#include "experts/expert_backend.h"

namespace moefit::experts {

std::unique_ptr<ExpertBackend> CreateEagerBackend(const BackendOptions& options);

}  // namespace moefit::experts
