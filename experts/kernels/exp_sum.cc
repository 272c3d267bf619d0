// The softmax's exponentials; see exp_sum.h.
#include "experts/kernels/exp_sum.h"

#include <c10/util/Exception.h>

#include "experts/kernels/internal/packed_kernels.h"

namespace moefit::experts::kernels {

float ExpSum(Isa isa, float* x, int64_t n, float scale, float shift) {
  TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(DetectIsa()), "ExpSum: ", IsaName(isa),
              " kernels cannot run on this CPU (", CpuFlags(), ")");
  return internal::KernelsFor(isa, /*narrow=*/false).exp_sum(x, n, scale, shift);
}

}  // namespace moefit::experts::kernels
