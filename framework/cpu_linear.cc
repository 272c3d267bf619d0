// Linear maps on the CPU on moefit's GEMM; see cpu_linear.h.
#include "framework/cpu_linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <vector>

#include "experts/kernels/gemm.h"

namespace moefit::framework {
namespace {

namespace kern = moefit::experts::kernels;

// Tokens per task of the forward and the input gradient.
constexpr int64_t kRowBlock = 256;
// Weight-gradient rows (output features) per task.
constexpr int64_t kFeatureBlock = 64;

int64_t NumBlocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

// Rows [r0, ...) of a float32 matrix with unit column stride, as an operand.
kern::Operand RowsOf(const at::Tensor& t, int64_t r0) {
  return {.data = t.data_ptr<float>() + r0 * t.stride(0), .row_stride = t.stride(0)};
}
// Columns [c0, ...) of it transposed: element (i, j) is t[j, c0 + i].
kern::Operand ColumnsTransposed(const at::Tensor& t, int64_t c0) {
  return {.data = t.data_ptr<float>() + c0, .row_stride = 1, .col_stride = t.stride(0)};
}
kern::Output OutRows(const at::Tensor& t, int64_t r0) {
  return {.data = t.data_ptr<float>() + r0 * t.stride(0), .row_stride = t.stride(0)};
}

// c = a · b (a [M, K], b K x n) by blocks of kRowBlock rows in parallel; with
// `bias` ([n]) added to each row of its block right after.
void ByRowBlocks(kern::Isa isa, const at::Tensor& a, const kern::Operand& b, int64_t n,
                 const at::Tensor& c, const at::Tensor& bias) {
  const int64_t m = a.size(0), k = a.size(1);
  const float* bias_p = bias.defined() ? bias.data_ptr<float>() : nullptr;
  at::parallel_for(0, NumBlocks(m, kRowBlock), 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r0 = blk * kRowBlock, rows = std::min(kRowBlock, m - r0);
      kern::Gemm(isa, rows, n, k, RowsOf(a, r0), b, OutRows(c, r0), /*accumulate=*/false,
                 kern::RowPath::kBlocked);
      if (bias_p == nullptr) continue;
      for (int64_t r = r0; r < r0 + rows; ++r) {
        float* row = c.data_ptr<float>() + r * c.stride(0);
        for (int64_t j = 0; j < n; ++j) row[j] += bias_p[j];
      }
    }
  });
}

// A 2-D view [rows, K] of x with unit column stride.
at::Tensor Flat(const at::Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  at::Tensor flat = x.reshape({rows, x.size(-1)});
  return flat.stride(1) == 1 ? flat : flat.contiguous();
}

class CpuLinearFunction : public torch::autograd::Function<CpuLinearFunction> {
 public:
  // bias: [N], or [0] for none.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight_in, const at::Tensor& bias) {
    const at::Tensor flat = Flat(x);
    const at::Tensor weight = weight_in.contiguous();
    const int64_t n = weight.size(0);
    at::Tensor y = at::empty({flat.size(0), n}, flat.options());
    // weightᵀ: element (k, j) is weight[j, k].
    ByRowBlocks(kern::ActiveIsa(), flat, ColumnsTransposed(weight, 0), n, y,
                bias.numel() > 0 ? bias.contiguous() : at::Tensor());
    ctx->save_for_backward({flat, weight});
    ctx->saved_data["has_bias"] = bias.numel() > 0;
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = n;
    ctx->saved_data["shape"] = shape;
    return y.view(shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "the CPU linear's backward cannot be differentiated again (create_graph)");
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &flat = saved[0], &weight = saved[1];
    const at::Tensor dy = Flat(grads[0]);
    const int64_t m = flat.size(0), k = flat.size(1), n = weight.size(0);
    const kern::Isa isa = kern::ActiveIsa();
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      // dx = dy · weight, by token blocks.
      dx = at::empty({m, k}, flat.options());
      ByRowBlocks(isa, dy, RowsOf(weight, 0), k, dx, at::Tensor());
      std::vector<int64_t> shape = ctx->saved_data["shape"].toIntVector();
      shape.back() = k;
      dx = dx.view(shape);
    }
    const bool want_dw = ctx->needs_input_grad(1);
    const bool want_db = ctx->needs_input_grad(2) && ctx->saved_data["has_bias"].toBool();
    if (want_dw) dw = at::empty({n, k}, flat.options());
    if (want_db) db = at::empty({n}, flat.options());
    if (want_dw || want_db) {
      // dw = dyᵀ · x and db = the column sums of dy, by feature blocks, each
      // over all the tokens in token order; x packed once for all the blocks
      // (the same bits as packing it in each block's call).
      // (No tokens or no inputs: dw is zero or empty, nothing to pack.)
      const bool gemm_dw = want_dw && m > 0 && k > 0;
      if (want_dw && !gemm_dw) dw.zero_();
      kern::PackedB x_packed;
      if (gemm_dw) x_packed = kern::PackedB(isa, kern::ElemType::kF32, m, k, RowsOf(flat, 0));
      at::parallel_for(0, NumBlocks(n, kFeatureBlock), 1, [&](int64_t begin, int64_t end) {
        for (int64_t blk = begin; blk < end; ++blk) {
          const int64_t f0 = blk * kFeatureBlock, features = std::min(kFeatureBlock, n - f0);
          if (gemm_dw) {
            kern::Gemm(isa, features, ColumnsTransposed(dy, f0), x_packed, OutRows(dw, f0),
                       /*accumulate=*/false, kern::RowPath::kBlocked);
          }
          if (want_db) {
            float* out = db.data_ptr<float>() + f0;
            std::fill(out, out + features, 0.0f);
            for (int64_t r = 0; r < m; ++r) {
              const float* row = dy.data_ptr<float>() + r * dy.stride(0) + f0;
              for (int64_t j = 0; j < features; ++j) out[j] += row[j];
            }
          }
        }
      });
    }
    return {dx, dw, db};
  }
};

}  // namespace

bool CpuLinearApplies(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  auto cpu_float = [](const at::Tensor& t) {
    return t.defined() && t.is_cpu() && t.scalar_type() == at::kFloat && !t.is_sparse();
  };
  if (!cpu_float(x) || !cpu_float(weight) || x.dim() < 1 || weight.dim() != 2 ||
      x.size(-1) != weight.size(1)) {
    return false;
  }
  return !bias.defined() || (cpu_float(bias) && bias.dim() == 1 && bias.size(0) == weight.size(0));
}

at::Tensor CpuLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(CpuLinearApplies(x, weight, bias),
              "CpuLinear: float32 CPU x [..., K], weight [N, K] and bias [N]; got x ", x.sizes(),
              ", weight ", weight.sizes());
  return CpuLinearFunction::apply(x, weight, bias.defined() ? bias : at::empty({0}, x.options()));
}

}  // namespace moefit::framework
