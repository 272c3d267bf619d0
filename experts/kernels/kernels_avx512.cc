// AVX-512 float32 kernels (compiled with -mavx512f -mavx512bw -mavx512vl
// -mfma -mf16c): pack_x86.h's float32 microkernel at 12 x 32 (24
// accumulators, masked partial stores), bfloat16 and FP8 operands converted
// to float32 as they are packed.
#include "experts/kernels/internal/x86_intrinsics.h"

#define MOEFIT_PACK_WIDTH 16
#include "experts/kernels/internal/bf16_rows_avx512.h"
#include "experts/kernels/internal/pack_x86.h"
#include "experts/kernels/internal/packed_kernels.h"
#include "experts/kernels/internal/swiglu_avx2.h"

namespace moefit::experts::kernels::internal {
namespace {

constexpr int kMr = kAvx512F32Mr;
constexpr int kNr = kAvx512F32Nr;
static_assert(kNr == 2 * kVl, "MicroF32's panel is two vectors wide");

}  // namespace

const PackedKernels& Avx512F32Kernels() {
  static const PackedKernels k{"avx512",
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
                               &StoreBf16RowAvx512};
  return k;
}

}  // namespace moefit::experts::kernels::internal
