// Causal self-attention on the CPU; see causal_attention.h.
#include "framework/causal_attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "experts/kernels/exp_sum.h"
#include "experts/kernels/gemm.h"

namespace moefit::framework {
namespace {

namespace kern = moefit::experts::kernels;

// Keys per block of the online softmax (the scores buffer is kQueryBlock x
// kKeyBlock floats per thread).
constexpr int64_t kKeyBlock = 256;

// A [B, heads, T, d] float32 tensor's element (b, h, t, 0) and its token
// stride, in floats.
struct Heads {
  float* data;
  int64_t batch_stride, head_stride, token_stride;

  explicit Heads(const at::Tensor& t)
      : data(t.data_ptr<float>()),
        batch_stride(t.stride(0)),
        head_stride(t.stride(1)),
        token_stride(t.stride(2)) {}
  float* Row(int64_t b, int64_t h, int64_t t) const {
    return data + b * batch_stride + h * head_stride + t * token_stride;
  }
};

// Rows of a Heads tensor as a GEMM operand: rows from `row`, d columns.
kern::Operand Rows(const Heads& x, int64_t b, int64_t h, int64_t row) {
  return {.data = x.Row(b, h, row), .row_stride = x.token_stride};
}
// The same rows transposed (d x rows): element (i, j) is row j's column i.
kern::Operand RowsTransposed(const Heads& x, int64_t b, int64_t h, int64_t row) {
  return {.data = x.Row(b, h, row), .row_stride = 1, .col_stride = x.token_stride};
}
// A row-major buffer with `ld` floats per row, as an operand and transposed.
kern::Operand Buffer(const float* p, int64_t ld) { return {.data = p, .row_stride = ld}; }
kern::Operand BufferTransposed(const float* p, int64_t ld) {
  return {.data = p, .row_stride = 1, .col_stride = ld};
}
kern::Output Out(float* p, int64_t ld) { return {.data = p, .row_stride = ld}; }

// The columns [lo, hi) of the key block [n0, n0 + nk) that query t sees: keys
// from its segment's start `first` to t (hi <= lo: none).
struct Visible {
  int64_t lo, hi;
};
Visible VisibleKeys(int64_t t, int64_t first, int64_t n0, int64_t nk) {
  return {std::max<int64_t>(first - n0, 0), std::min(nk, t - n0 + 1)};
}

int64_t NumBlocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

// Query block qb's rows [m0, m0 + mq) and the keys [kv_begin, kv_end) any of
// them sees (first[t]: token t's first visible key).
struct QueryBlock {
  int64_t m0, mq, kv_begin, kv_end;
};
QueryBlock QueryBlockOf(int64_t qb, int64_t t_size, const int64_t* first) {
  const int64_t m0 = qb * kQueryBlock, mq = std::min(kQueryBlock, t_size - m0);
  return {m0, mq, *std::min_element(first + m0, first + m0 + mq), m0 + mq};
}

// A [B, heads, T, d] view of fresh [B, T, heads, d] storage.
at::Tensor TokenMajor(int64_t b, int64_t heads, int64_t t, int64_t d) {
  return at::empty({b, t, heads, d}, at::kFloat).transpose(1, 2);
}

// Per-thread scratch of the kernels.
struct Scratch {
  std::vector<float> scores, dscores, acc, max, sum, delta;
};

// out = softmax(q k^T scale, masked) v and lse (logsumexp of each row's
// scaled scores) for query block qb of head (b, h); first[t] is token t's
// first visible key (its segment's start).
void ForwardBlock(kern::Isa isa, const Heads& q, const Heads& k, const Heads& v, const Heads& out,
                  float* lse, const int64_t* first, int64_t b, int64_t h, int64_t kvh, int64_t qb,
                  int64_t t_size, int64_t dk, int64_t dv, float scale, Scratch& s) {
  const auto [m0, mq, kv_begin, kv_end] = QueryBlockOf(qb, t_size, first);
  s.scores.resize(kQueryBlock * kKeyBlock);
  s.acc.resize(kQueryBlock * dv);
  s.max.assign(mq, -std::numeric_limits<float>::infinity());
  s.sum.assign(mq, 0.0f);
  float* scores = s.scores.data();
  float* acc = s.acc.data();
  for (int64_t n0 = kv_begin; n0 < kv_end; n0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, kv_end - n0);
    const bool first_block = n0 == kv_begin;
    kern::Gemm(isa, mq, nk, dk, Rows(q, b, h, m0), RowsTransposed(k, b, kvh, n0),
               Out(scores, kKeyBlock), /*accumulate=*/false);
    for (int64_t r = 0; r < mq; ++r) {
      float* row = scores + r * kKeyBlock;
      const Visible vis = VisibleKeys(m0 + r, first[m0 + r], n0, nk);
      if (vis.hi <= vis.lo) {  // none here: a zero row (its sums unchanged)
        std::fill(row, row + nk, 0.0f);
        continue;
      }
      const float block_max = *std::max_element(row + vis.lo, row + vis.hi) * scale;
      const float new_max = std::max(s.max[r], block_max);
      // What the sums so far are worth against the new maximum (the first
      // block's GEMM writes acc rather than adding to it).
      const float rescale = first_block ? 0.0f : std::exp(s.max[r] - new_max);
      const float block_sum = kern::ExpSum(isa, row + vis.lo, vis.hi - vis.lo, scale, new_max);
      std::fill(row, row + vis.lo, 0.0f);
      std::fill(row + vis.hi, row + nk, 0.0f);
      if (!first_block && rescale != 1.0f) {
        float* acc_row = acc + r * dv;
        for (int64_t j = 0; j < dv; ++j) acc_row[j] *= rescale;
      }
      s.sum[r] = s.sum[r] * rescale + block_sum;
      s.max[r] = new_max;
    }
    kern::Gemm(isa, mq, dv, nk, Buffer(scores, kKeyBlock), Rows(v, b, kvh, n0), Out(acc, dv),
               /*accumulate=*/!first_block);
  }
  for (int64_t r = 0; r < mq; ++r) {
    const float inv = 1.0f / s.sum[r];
    float* o = out.Row(b, h, m0 + r);
    for (int64_t j = 0; j < dv; ++j) o[j] = acc[r * dv + j] * inv;
    lse[m0 + r] = s.max[r] + std::log(s.sum[r]);
  }
}

// The gradients of head (b, h), which reads key-value head kvh: dq of its
// rows, and its contributions to the key and value gradients, added into dk
// and dv (per query head: their rows of head h).
void BackwardHead(kern::Isa isa, const Heads& q, const Heads& k, const Heads& v, const Heads& out,
                  const Heads& dout, const float* lse, const int64_t* first, const Heads& dq,
                  const Heads& dk, const Heads& dv, int64_t b, int64_t h, int64_t kvh,
                  int64_t t_size, int64_t d_qk, int64_t d_v, float scale, Scratch& s) {
  s.scores.resize(kQueryBlock * kKeyBlock);
  s.dscores.resize(kQueryBlock * kKeyBlock);
  s.delta.resize(kQueryBlock);
  float* p = s.scores.data();
  float* ds = s.dscores.data();
  for (int64_t qb = 0; qb < NumBlocks(t_size, kQueryBlock); ++qb) {
    const auto [m0, mq, kv_begin, kv_end] = QueryBlockOf(qb, t_size, first);
    // delta_r = sum_j dout_rj out_rj: the softmax backward's row term.
    for (int64_t r = 0; r < mq; ++r) {
      const float* o = out.Row(b, h, m0 + r);
      const float* g = dout.Row(b, h, m0 + r);
      float d = 0;
      for (int64_t j = 0; j < d_v; ++j) d += o[j] * g[j];
      s.delta[r] = d;
    }
    for (int64_t n0 = kv_begin; n0 < kv_end; n0 += kKeyBlock) {
      const int64_t nk = std::min(kKeyBlock, kv_end - n0);
      // P = exp(q k^T scale - lse), 0 where masked.
      kern::Gemm(isa, mq, nk, d_qk, Rows(q, b, h, m0), RowsTransposed(k, b, kvh, n0),
                 Out(p, kKeyBlock), /*accumulate=*/false);
      for (int64_t r = 0; r < mq; ++r) {
        float* row = p + r * kKeyBlock;
        const Visible vis = VisibleKeys(m0 + r, first[m0 + r], n0, nk);
        const int64_t lo = std::min(vis.lo, nk), hi = std::max(vis.hi, lo);
        kern::ExpSum(isa, row + lo, hi - lo, scale, lse[m0 + r]);
        std::fill(row, row + lo, 0.0f);
        std::fill(row + hi, row + nk, 0.0f);
      }
      // dv += P^T dout; dP = dout v^T.
      kern::Gemm(isa, nk, d_v, mq, BufferTransposed(p, kKeyBlock), Rows(dout, b, h, m0),
                 Out(dv.Row(b, h, n0), dv.token_stride), /*accumulate=*/true);
      kern::Gemm(isa, mq, nk, d_v, Rows(dout, b, h, m0), RowsTransposed(v, b, kvh, n0),
                 Out(ds, kKeyBlock), /*accumulate=*/false);
      // dS = P (dP - delta) scale: the scores' gradient (0 where P is).
      for (int64_t r = 0; r < mq; ++r) {
        const float* pr = p + r * kKeyBlock;
        float* dr = ds + r * kKeyBlock;
        const float delta = s.delta[r];
        for (int64_t j = 0; j < nk; ++j) dr[j] = pr[j] * (dr[j] - delta) * scale;
      }
      // dq += dS k; dk += dS^T q.
      kern::Gemm(isa, mq, d_qk, nk, Buffer(ds, kKeyBlock), Rows(k, b, kvh, n0),
                 Out(dq.Row(b, h, m0), dq.token_stride), /*accumulate=*/n0 > kv_begin);
      kern::Gemm(isa, nk, d_qk, mq, BufferTransposed(ds, kKeyBlock), Rows(q, b, h, m0),
                 Out(dk.Row(b, h, n0), dk.token_stride), /*accumulate=*/true);
    }
  }
}

// Per-query-head gradients [B, heads, T, d] (TokenMajor) summed over each
// group of heads / kv_heads consecutive heads, in head order -> [B, kv_heads,
// T, d], also token-major: one pass over the rows.
at::Tensor SumGroups(const at::Tensor& per_head, int64_t kv_heads) {
  const int64_t batch = per_head.size(0), heads = per_head.size(1);
  const int64_t t_size = per_head.size(2), d = per_head.size(3);
  if (heads == kv_heads) return per_head;
  const int64_t groups = heads / kv_heads;
  at::Tensor out = TokenMajor(batch, kv_heads, t_size, d);
  const Heads in(per_head), o(out);
  at::parallel_for(0, batch * t_size, 16, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / t_size, t = bt % t_size;
      for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
        float* dst = o.Row(b, kvh, t);
        const float* head0 = in.Row(b, kvh * groups, t);
        std::copy(head0, head0 + d, dst);
        for (int64_t g = 1; g < groups; ++g) {
          const float* src = in.Row(b, kvh * groups + g, t);
          for (int64_t j = 0; j < d; ++j) dst[j] += src[j];
        }
      }
    }
  });
  return out;
}

class CausalAttentionFunction : public torch::autograd::Function<CausalAttentionFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q_in,
                            const at::Tensor& k_in, const at::Tensor& v_in, double scale,
                            const at::Tensor& first_keys) {
    const at::Tensor q = LastDimContiguous(q_in), k = LastDimContiguous(k_in),
                     v = LastDimContiguous(v_in);
    const int64_t batch = q.size(0), heads = q.size(1), t_size = q.size(2);
    const int64_t groups = heads / k.size(1), dk = q.size(3), dv = v.size(3);
    const at::Tensor first = first_keys.contiguous();
    const int64_t* first_p = first.data_ptr<int64_t>();
    at::Tensor out = TokenMajor(batch, heads, t_size, dv);
    at::Tensor lse = at::empty({batch, heads, t_size}, at::kFloat);
    const Heads hq(q), hk(k), hv(v), ho(out);
    float* lse_p = lse.data_ptr<float>();
    const kern::Isa isa = kern::ActiveIsa();
    const int64_t q_blocks = NumBlocks(t_size, kQueryBlock);
    at::parallel_for(0, batch * heads * q_blocks, 1, [&](int64_t begin, int64_t end) {
      thread_local Scratch s;
      for (int64_t u = begin; u < end; ++u) {
        const int64_t qb = u % q_blocks, bh = u / q_blocks, b = bh / heads, h = bh % heads;
        ForwardBlock(isa, hq, hk, hv, ho, lse_p + bh * t_size, first_p + b * t_size, b, h,
                     h / groups, qb, t_size, dk, dv, static_cast<float>(scale), s);
      }
    });
    ctx->save_for_backward({q, k, v, out, lse, first});
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "causal attention's backward cannot be differentiated again (create_graph)");
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4],
                     &first = saved[5];
    const at::Tensor dout = LastDimContiguous(grads[0]);
    const float scale = static_cast<float>(ctx->saved_data["scale"].toDouble());
    const int64_t batch = q.size(0), heads = q.size(1), t_size = q.size(2);
    const int64_t kv_heads = k.size(1), groups = heads / kv_heads;
    const int64_t d_qk = q.size(3), d_v = v.size(3);
    at::Tensor dq = TokenMajor(batch, heads, t_size, d_qk);
    // Key and value gradients per query head (summed over each group after),
    // so that the heads of a group run on any threads.
    at::Tensor dk = TokenMajor(batch, heads, t_size, d_qk).zero_();
    at::Tensor dv = TokenMajor(batch, heads, t_size, d_v).zero_();
    const Heads hq(q), hk(k), hv(v), ho(out), hg(dout), hdq(dq), hdk(dk), hdv(dv);
    const float* lse_p = lse.data_ptr<float>();
    const int64_t* first_p = first.data_ptr<int64_t>();
    const kern::Isa isa = kern::ActiveIsa();
    at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
      thread_local Scratch s;
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / heads, h = bh % heads;
        BackwardHead(isa, hq, hk, hv, ho, hg, lse_p + bh * t_size, first_p + b * t_size, hdq, hdk,
                     hdv, b, h, h / groups, t_size, d_qk, d_v, scale, s);
      }
    });
    return {dq, SumGroups(dk, kv_heads), SumGroups(dv, kv_heads), at::Tensor(), at::Tensor()};
  }

 private:
  static at::Tensor LastDimContiguous(const at::Tensor& t) {
    return t.stride(-1) == 1 ? t : t.contiguous();
  }
};

}  // namespace

bool CausalAttentionApplies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  auto cpu_float = [](const at::Tensor& t) {
    return t.defined() && t.is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 4 &&
           !t.is_sparse();
  };
  if (!cpu_float(q) || !cpu_float(k) || !cpu_float(v)) return false;
  return k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) > 0 &&
         q.size(1) % k.size(1) == 0 && v.size(1) == k.size(1) && k.size(2) == q.size(2) &&
         v.size(2) == q.size(2) && k.size(3) == q.size(3);
}

at::Tensor SegmentStarts(const at::Tensor& segment_ids) {
  TORCH_CHECK(segment_ids.dim() == 2, "SegmentStarts: segment_ids [B, T], got ",
              segment_ids.sizes());
  const at::Tensor ids = segment_ids.to(at::kCPU, at::kLong).contiguous();
  at::Tensor starts = at::empty_like(ids);
  const int64_t* ip = ids.data_ptr<int64_t>();
  int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t t_size = ids.size(1);
  for (int64_t b = 0; b < ids.size(0); ++b) {
    for (int64_t t = 0; t < t_size; ++t) {
      const int64_t i = b * t_size + t;
      sp[i] = t > 0 && ip[i] == ip[i - 1] ? sp[i - 1] : t;
    }
  }
  return starts;
}

at::Tensor CausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           double scale, const at::Tensor& segment_starts) {
  TORCH_CHECK(CausalAttentionApplies(q, k, v),
              "CausalAttention: q [B, H, T, dk], k [B, Hkv, T, dk], v [B, Hkv, T, dv] float32 "
              "CPU tensors with H a multiple of Hkv; got q ",
              q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(!segment_starts.defined() ||
                  (segment_starts.is_cpu() && segment_starts.scalar_type() == at::kLong &&
                   segment_starts.sizes() == at::IntArrayRef({q.size(0), q.size(2)})),
              "CausalAttention: segment_starts must be [B, T] int64 on the CPU, got ",
              segment_starts.sizes());
  if (segment_starts.defined()) {
    const at::Tensor t = at::arange(q.size(2), at::kLong);
    TORCH_CHECK(segment_starts.ge(0).logical_and(segment_starts.le(t)).all().item<bool>(),
                "CausalAttention: segment_starts[b, t] must lie in [0, t]");
  }
  // Each token's first visible key: its segment's start, or 0 throughout.
  const at::Tensor first_keys =
      segment_starts.defined() ? segment_starts : at::zeros({q.size(0), q.size(2)}, at::kLong);
  return CausalAttentionFunction::apply(q, k, v, scale, first_keys);
}

}  // namespace moefit::framework
