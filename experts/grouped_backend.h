// `grouped`: the fast CPU expert backend. Rows arrive sorted by expert; the
// work is cut into (expert, row-block) tiles so that a hot expert spreads over
// all cores while cold ones cost nothing, and the tiles run in parallel on a
// oneTBB arena with single-threaded GEMMs. Gate and up come out of one GEMM
// against the packed [2I, H] weight; SiLU(gate)·up (and its derivative in the
// backward pass) is one fused pass over the tile. LoRA adapters add two thin
// GEMMs per projection to the same tiles (in fp32 for a bf16 base), and their
// gradients are summed per expert beside the base weight gradients, which a
// frozen base skips.
#pragma once

#include <memory>

#include "experts/expert_backend.h"

namespace moefit::experts {

std::unique_ptr<ExpertBackend> CreateGroupedBackend(const BackendOptions& options);

}  // namespace moefit::experts
