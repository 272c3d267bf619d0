// AVX2 + FMA float32 kernels (compiled with -mavx2 -mfma -mf16c):
// pack_x86.h's float32 microkernel at 6 x 16 (12 accumulators), bfloat16 and
// FP8 operands converted to float32 as they are packed.
#include "experts/kernels/internal/x86_intrinsics.h"

#define MOEFIT_PACK_WIDTH 8
#include "experts/kernels/internal/bf16_rows_avx2.h"
#include "experts/kernels/internal/pack_x86.h"
#include "experts/kernels/internal/packed_kernels.h"
#include "experts/kernels/internal/swiglu_avx2.h"

namespace moefit::experts::kernels::internal {
namespace {

constexpr int kMr = 6;
constexpr int kNr = 16;
static_assert(kNr == 2 * kVl, "MicroF32's panel is two vectors wide");

}  // namespace

const PackedKernels& Avx2F32Kernels() {
  static const PackedKernels k{"avx2",
                               kMr,
                               kNr,
                               /*kb=*/256,
                               /*nb=*/2048,
                               /*mb=*/96,
                               /*pairs=*/false,
                               &PackAF32<kMr>,
                               &PackBF32<kNr>,
                               &MicroF32<kMr>,
                               &SmallRows<>,
                               &SiluMulAvx2,
                               &SiluMulBackwardAvx2,
                               &ExpSumAvx2,
                               &StoreBf16RowAvx2};
  return k;
}

}  // namespace moefit::experts::kernels::internal
