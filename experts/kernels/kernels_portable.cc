// Portable float32 kernels: plain C++ for the baseline target, the path every
// x86-64 CPU can run and the one the wider sets are checked against.
#include "experts/kernels/internal/pack_common.h"
#include "experts/kernels/internal/packed_kernels.h"
#include "experts/kernels/internal/swiglu_scalar.h"

namespace moefit::experts::kernels::internal {
namespace {

constexpr int kMr = 4;
constexpr int kNr = 16;

template <int kRows>
void MicroRows(int64_t k_size, const float* ap, const float* bp, float* tile) {
  float acc[kRows][kNr] = {};
  for (int64_t k = 0; k < k_size; ++k) {
    const float* b = bp + k * kNr;
    const float* a = ap + k * kMr;
    for (int r = 0; r < kRows; ++r) {
      for (int j = 0; j < kNr; ++j) acc[r][j] += a[r] * b[j];
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < kNr; ++j) tile[r * kNr + j] = acc[r][j];
  }
}

void Micro(int64_t k_size, const void* a_panel, const void* b_panel, float* c, int64_t ldc,
           int rows, int cols, bool accumulate) {
  float tile[kMr * kNr];
  const auto* ap = static_cast<const float*>(a_panel);
  const auto* bp = static_cast<const float*>(b_panel);
  WithRows<kMr>(rows, [&]<int R>() { MicroRows<R>(k_size, ap, bp, tile); });
  StoreTile<kNr>(tile, c, ldc, rows, cols, accumulate);
}

}  // namespace

const PackedKernels& PortableF32Kernels() {
  static const PackedKernels k{"portable",
                               kMr,
                               kNr,
                               /*kb=*/256,
                               /*nb=*/4096,
                               /*mb=*/64,
                               /*pairs=*/false,
                               &PackAGeneric<kMr, false>,
                               &PackBGeneric<kNr, false>,
                               &Micro,
                               nullptr,
                               &SiluMulScalar,
                               &SiluMulBackwardScalar,
                               &ExpSumScalar,
                               &StoreBf16RowScalar};
  return k;
}

}  // namespace moefit::experts::kernels::internal
