// AVX-512 float32 kernels (compiled with -mavx512f -mavx512bw -mavx512vl
// -mfma -mf16c): the 12 x 32 microkernel of internal/micro_f32_avx512.h,
// bfloat16 and FP8 operands converted to float32 as they are packed.
#include "experts/kernels/internal/x86_intrinsics.h"

#define MOEFIT_PACK_WIDTH 16
#include "experts/kernels/internal/bf16_rows_avx512.h"
#include "experts/kernels/internal/micro_f32_avx512.h"
#include "experts/kernels/internal/pack_x86.h"
#include "experts/kernels/internal/packed_kernels.h"
#include "experts/kernels/internal/swiglu_avx2.h"

namespace moefit::experts::kernels::internal {

const PackedKernels& Avx512F32Kernels() {
  static const PackedKernels k{"avx512",
                               kMrF32Avx512,
                               kNrF32Avx512,
                               /*kb=*/256,
                               /*nb=*/2048,
                               /*mb=*/96,
                               /*pairs=*/false,
                               &PackAF32<kMrF32Avx512>,
                               &PackBF32<kNrF32Avx512>,
                               &MicroF32Avx512,
                               &SmallRows<>,
                               &SiluMulAvx2,
                               &SiluMulBackwardAvx2,
                               &StoreBf16RowAvx512};
  return k;
}

}  // namespace moefit::experts::kernels::internal
