// SwiGLU's activation over rows; see swiglu.h.
#include "experts/kernels/swiglu.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <vector>

#include "experts/kernels/internal/packed_kernels.h"

namespace moefit::experts::kernels {
namespace {

// The float32 kernels of `isa` (each set's tables carry SwiGLU's activation).
const internal::PackedKernels& Float32Kernels(Isa isa) {
  TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(DetectIsa()), "SiluMul: ", IsaName(isa),
              " kernels cannot run on this CPU (", CpuFlags(), ")");
  return internal::KernelsFor(isa, /*narrow=*/false);
}

// Row i of `r` as float32: the row itself, or converted into `buf`.
const float* Load(const Rows& r, int64_t i, int64_t n, std::vector<float>& buf) {
  if (r.type == ElemType::kF32) return static_cast<const float*>(r.data) + i * r.row_stride;
  TORCH_CHECK(r.type == ElemType::kBF16, "SiluMul: rows are float32 or bfloat16");
  const uint16_t* src = static_cast<const uint16_t*>(r.data) + i * r.row_stride;
  buf.resize(n);
  for (int64_t j = 0; j < n; ++j) {
    buf[j] = static_cast<float>(c10::BFloat16(src[j], c10::BFloat16::from_bits()));
  }
  return buf.data();
}

// Where row i of `r` is computed: in place, or in `buf` (then Store).
float* Target(const Rows& r, int64_t i, int64_t n, std::vector<float>& buf) {
  if (r.type == ElemType::kF32) return static_cast<float*>(r.data) + i * r.row_stride;
  TORCH_CHECK(r.type == ElemType::kBF16, "SiluMul: rows are float32 or bfloat16");
  buf.resize(n);
  return buf.data();
}

void Store(const internal::PackedKernels& kern, const Rows& r, int64_t i, int64_t n,
           const std::vector<float>& buf) {
  if (r.type == ElemType::kF32) return;
  kern.store_bf16(buf.data(), static_cast<uint16_t*>(r.data) + i * r.row_stride, n,
                  /*accumulate=*/false);
}

// Per-thread conversion rows.
struct Buffers {
  std::vector<float> g, u, dh, h, dg, du;
};

}  // namespace

void SiluMul(Isa isa, int64_t m, int64_t n, const Rows& gate, const Rows& up, const Rows& h) {
  const internal::PackedKernels& kern = Float32Kernels(isa);
  thread_local Buffers b;
  for (int64_t i = 0; i < m; ++i) {
    const float* g = Load(gate, i, n, b.g);
    const float* u = Load(up, i, n, b.u);
    float* out = Target(h, i, n, b.h);
    kern.silu_mul(g, u, out, n);
    Store(kern, h, i, n, b.h);
  }
}

void SiluMulBackward(Isa isa, int64_t m, int64_t n, const Rows& gate, const Rows& up,
                     const Rows& dh, const Rows& h, const Rows& d_gate, const Rows& d_up) {
  const internal::PackedKernels& kern = Float32Kernels(isa);
  thread_local Buffers b;
  for (int64_t i = 0; i < m; ++i) {
    const float* g = Load(gate, i, n, b.g);
    const float* u = Load(up, i, n, b.u);
    const float* d = Load(dh, i, n, b.dh);
    float* h_out = Target(h, i, n, b.h);
    float* dg = Target(d_gate, i, n, b.dg);
    float* du = Target(d_up, i, n, b.du);
    kern.silu_mul_backward(g, u, d, h_out, dg, du, n);
    Store(kern, h, i, n, b.h);
    Store(kern, d_gate, i, n, b.dg);
    Store(kern, d_up, i, n, b.du);
  }
}

}  // namespace moefit::experts::kernels
