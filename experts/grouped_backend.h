// `grouped`: the fast CPU expert backend. Rows arrive sorted by expert; the
// work is cut into (expert, row-block) tiles so that a hot expert spreads over
// all cores while cold ones cost nothing, and the tiles run in parallel, handed
// out one at a time, with single-threaded GEMMs: on LibTorch's OpenMP threads
// (the process's one pool) or on a oneTBB arena of the backend's own
// (BackendOptions::thread_pool). Each weight is packed into the
// kernels' format once per change, not per GEMM (packed_weights.h). Gate and
// up are computed a block of columns at a time, and SiLU(gate)·up of a block
// right after its two GEMMs, with a vector exp (with a LoRA adapter on
// gate/up, whose term must be added first: after the tile's whole GEMM); the
// backward's SwiGLU derivative is one vector pass over the tile.
// BackendOptions::fused_swiglu false keeps the scalar twin. LoRA adapters add
// two thin GEMMs per projection to the same tiles (in fp32 for a bf16 base),
// and their gradients are summed per expert beside the base weight gradients,
// which a frozen base skips.
#pragma once

#include <memory>

#include "experts/expert_backend.h"

namespace moefit::experts {

std::unique_ptr<ExpertBackend> CreateGroupedBackend(const BackendOptions& options);

}  // namespace moefit::experts
