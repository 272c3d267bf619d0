// GQA and multi-head latent attention, rotary tables; see attention.h.
#include "framework/attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "framework/causal_attention.h"

namespace moefit::framework {
namespace {

// HF's DeepseekV3RMSNorm on the compressed q and kv uses its default epsilon,
// not rms_norm_eps.
constexpr double kLatentNormEps = 1e-6;

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// RoPE on the last dim of x (its size is the tables' rotary_dim). Interleaved:
// the rotated pairs are (x0, x1), (x2, x3), ... and the result lists the
// first members then the second ones, as HF's apply_rotary_pos_emb_interleave.
at::Tensor Rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  bool interleaved) {
  if (!interleaved) return x * cos + RotateHalf(x) * sin;
  const int64_t half = cos.size(-1) / 2;
  at::Tensor c = cos.narrow(-1, 0, half), s = sin.narrow(-1, 0, half);
  at::Tensor x1 = x.slice(-1, 0, x.size(-1), 2), x2 = x.slice(-1, 1, x.size(-1), 2);
  return at::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
}

// RoPE on the first rotary_dim dims of x, the rest passed through (GQA).
at::Tensor RotatePartial(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rotary_dim = cos.size(-1);
  if (rotary_dim == x.size(-1)) return Rotate(x, cos, sin, /*interleaved=*/false);
  return at::cat({Rotate(x.narrow(-1, 0, rotary_dim), cos, sin, /*interleaved=*/false),
                  x.narrow(-1, rotary_dim, x.size(-1) - rotary_dim)},
                 -1);
}

// Scaled dot-product attention; k and v may carry fewer heads than q (GQA:
// query head h reads key-value head h / (heads / kv_heads)). Causal, and
// within segments where segment_ids is defined. Float32 attention on the CPU
// takes moefit's kernel, which skips the scores it masks
// (causal_attention.h); otherwise SDPA, causal through its is_causal fast
// path, or with the explicit mask of packed sequences (is_causal and a mask
// are exclusive in SDPA; the mask is causal itself).
at::Tensor Attend(const at::Tensor& q, at::Tensor k, at::Tensor v, const at::Tensor& segment_ids,
                  double scale) {
  if (CausalAttentionApplies(q, k, v)) {
    return CausalAttention(q, k, v, scale,
                           segment_ids.defined() ? SegmentStarts(segment_ids) : at::Tensor());
  }
  const int64_t groups = q.size(1) / k.size(1);
  if (groups > 1) {
    k = k.repeat_interleave(groups, 1);
    v = v.repeat_interleave(groups, 1);
  }
  if (!segment_ids.defined()) {
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                            /*is_causal=*/true, scale);
  }
  return at::scaled_dot_product_attention(q, k, v, SegmentCausalMask(segment_ids),
                                          /*dropout_p=*/0.0, /*is_causal=*/false, scale);
}

// YaRN's magnitude correction 0.1 * m * ln(s) + 1 (1 for s <= 1).
double YarnMscale(double scale, double m) {
  return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}

// Sum over j < n of a[j] * b[j] in float32, in 16 interleaved partial sums
// (which the compiler turns into vector lanes).
float Dot(const float* a, const float* b, int64_t n) {
  constexpr int kLanes = 16;
  float part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) part[l] += a[j + l] * b[j + l];
  }
  for (int l = 0; j < n; ++j, ++l) part[l] += a[j] * b[j];
  float sum = 0;
  for (float v : part) sum += v;
  return sum;
}

// RMSNorm of float32 rows on the CPU, y = w · (x · r) with r = 1 / sqrt(mean(x²)
// + eps), forward and backward in one pass over the rows each (the composite
// form makes five elementwise passes forward and more backward):
//   dx = r · (w·dy) - x · r³ · sum(w·dy·x) / H,   dw = sum over rows of dy · x · r.
// The formula is the composite's; only the order of the sums differs.
class CpuRmsNorm : public torch::autograd::Function<CpuRmsNorm> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x_in,
                            const at::Tensor& weight_in, double eps) {
    const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
    const int64_t h = x.size(-1), rows = h == 0 ? 0 : x.numel() / h;
    at::Tensor y = at::empty_like(x), rstd = at::empty({rows}, x.options());
    const float* xp = x.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    float* rp = rstd.data_ptr<float>();
    at::parallel_for(0, rows, Grain(h), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float* xi = xp + i * h;
        const float r =
            1.0f / std::sqrt(Dot(xi, xi, h) / static_cast<float>(h) + static_cast<float>(eps));
        rp[i] = r;
        float* yi = yp + i * h;
        for (int64_t j = 0; j < h; ++j) yi[j] = wp[j] * (xi[j] * r);
      }
    });
    ctx->save_for_backward({x, weight, rstd});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "RMSNorm's fused backward cannot be differentiated again (create_graph)");
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &rstd = saved[2];
    const at::Tensor dy = grads[0].contiguous();
    const int64_t h = x.size(-1), rows = rstd.numel();
    const bool want_dx = ctx->needs_input_grad(0), want_dw = ctx->needs_input_grad(1);
    at::Tensor dx = want_dx ? at::empty_like(x) : at::Tensor();
    // dw summed per thread, then over threads (slots by at::get_thread_num(),
    // as at::parallel_reduce keeps its partial results).
    const int threads = at::get_num_threads();
    std::vector<float> dw_part(want_dw ? static_cast<size_t>(threads * h) : 0, 0.0f);
    const float* xp = x.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    const float* rp = rstd.data_ptr<float>();
    const float* gp = dy.data_ptr<float>();
    float* dxp = want_dx ? dx.data_ptr<float>() : nullptr;
    at::parallel_for(0, rows, Grain(h), [&](int64_t begin, int64_t end) {
      std::vector<float> wg(static_cast<size_t>(h));
      float* dw = want_dw ? dw_part.data() + at::get_thread_num() * h : nullptr;
      for (int64_t i = begin; i < end; ++i) {
        const float *xi = xp + i * h, *gi = gp + i * h;
        const float r = rp[i];
        if (dw != nullptr) {
          for (int64_t j = 0; j < h; ++j) dw[j] += gi[j] * (xi[j] * r);
        }
        if (dxp == nullptr) continue;
        for (int64_t j = 0; j < h; ++j) wg[j] = wp[j] * gi[j];
        const float c = Dot(wg.data(), xi, h) * r * r * r / static_cast<float>(h);
        float* di = dxp + i * h;
        for (int64_t j = 0; j < h; ++j) di[j] = r * wg[j] - xi[j] * c;
      }
    });
    at::Tensor dw;
    if (want_dw) {
      dw = at::zeros_like(weight);
      float* out = dw.data_ptr<float>();
      for (int t = 0; t < threads; ++t) {
        for (int64_t j = 0; j < h; ++j) out[j] += dw_part[t * h + j];
      }
    }
    return {dx, dw, at::Tensor()};
  }

 private:
  // Rows per task: about 16K elements.
  static int64_t Grain(int64_t h) {
    return std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(h, 1));
  }
};

}  // namespace

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (x.is_cpu() && weight.is_cpu() && x.scalar_type() == at::kFloat &&
      weight.scalar_type() == at::kFloat && weight.dim() == 1 && x.dim() >= 1 &&
      weight.size(0) == x.size(-1)) {
    return CpuRmsNorm::apply(x, weight, eps);
  }
  at::Tensor xf = x.to(at::promote_types(x.scalar_type(), at::kFloat));
  at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(x.scalar_type());
}

RotaryTables ComputeRotaryTables(const ModelOptions& o, int64_t num_positions, c10::Device device) {
  const int64_t dim = o.rotary_dim();
  const at::TensorOptions f32 = at::TensorOptions(device).dtype(at::kFloat);
  // inv_freq = theta^(-2i/d), computed as transformers does (fp32 pow).
  at::Tensor exponents =
      at::arange(0, dim, 2, at::TensorOptions(device).dtype(at::kLong)).to(at::kFloat) /
      static_cast<double>(dim);
  at::Tensor pos_freqs = at::pow(o.rope_theta, exponents);
  at::Tensor inv_freq = 1.0 / pos_freqs;
  double attention_factor = 1.0;
  RotaryTables out;
  out.softmax_scale = 1.0 / std::sqrt(static_cast<double>(o.qk_head_dim()));
  const RopeScaling& r = o.rope_scaling;
  if (r.type == "yarn") {
    // Frequencies below beta_slow rotations over the original context are
    // interpolated (divided by factor), those above beta_fast kept, with a
    // linear ramp between.
    const double base = o.rope_theta;
    const double orig = static_cast<double>(r.original_max_position_embeddings);
    auto correction_dim = [&](double rotations) {
      return static_cast<double>(dim) * std::log(orig / (rotations * 2 * M_PI)) /
             (2 * std::log(base));
    };
    double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
    if (r.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    if (low == high) high += 0.001;
    at::Tensor ramp = at::clamp((at::arange(dim / 2, f32) - low) / (high - low), 0, 1);
    at::Tensor extrapolation = 1 - ramp;
    at::Tensor interpolated = 1.0 / (r.factor * pos_freqs);
    inv_freq = interpolated * (1 - extrapolation) + inv_freq * extrapolation;
    if (r.attention_factor) {
      attention_factor = *r.attention_factor;
    } else if (r.mscale != 0 && r.mscale_all_dim != 0) {
      attention_factor = YarnMscale(r.factor, r.mscale) / YarnMscale(r.factor, r.mscale_all_dim);
    } else {
      attention_factor = YarnMscale(r.factor, 1.0);
    }
    // DeepSeek's attention also scales the logits by mscale_all_dim's
    // correction squared (HF yarn_apply_mscale).
    if (o.attention == AttentionKind::kMla && r.mscale_all_dim != 0) {
      const double m = YarnMscale(r.factor, r.mscale_all_dim);
      out.softmax_scale *= m * m;
    }
  }
  at::Tensor freqs = at::outer(at::arange(num_positions, f32), inv_freq);
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  out.cos = emb.cos() * attention_factor;
  out.sin = emb.sin() * attention_factor;
  return out;
}

RotaryTables ComputeRotaryTables(const ModelOptions& o, const at::Tensor& position_ids,
                                 c10::Device device) {
  at::Tensor pos = position_ids.to(device);
  RotaryTables out = ComputeRotaryTables(o, pos.max().item<int64_t>() + 1, device);
  const int64_t b = pos.size(0), t = pos.size(1);
  auto gather = [&](const at::Tensor& table) {
    return table.index_select(0, pos.reshape({-1})).view({b, 1, t, table.size(-1)});
  };
  out.cos = gather(out.cos);
  out.sin = gather(out.sin);
  return out;
}

at::Tensor SegmentCausalMask(const at::Tensor& segment_ids) {
  const int64_t t = segment_ids.size(1);
  at::Tensor same = segment_ids.unsqueeze(2).eq(segment_ids.unsqueeze(1));  // [B, T, T]
  at::Tensor causal =
      at::ones({t, t}, segment_ids.options().dtype(at::kBool)).tril();  // key j <= query i
  return same.logical_and(causal).unsqueeze(1);
}

at::Tensor GqaAttention(const ModelOptions& o, const GqaWeights& w, const at::Tensor& x,
                        const RotaryTables& rope, const at::Tensor& segment_ids) {
  const int64_t b = x.size(0), t = x.size(1), hd = o.head_dim;
  auto heads = [&](const at::Tensor& proj, const at::Tensor& bias, const LoraAdapter& lora,
                   int64_t n) {
    return Linear(x, proj, bias, lora).view({b, t, n, hd});
  };
  at::Tensor q = heads(w.q_proj, w.q_bias, w.q_lora, o.num_attention_heads);
  at::Tensor k = heads(w.k_proj, w.k_bias, w.k_lora, o.num_key_value_heads);
  at::Tensor v = heads(w.v_proj, w.v_bias, w.v_lora, o.num_key_value_heads).transpose(1, 2);
  if (o.qk_norm) {
    q = RmsNorm(q, w.q_norm, o.rms_norm_eps);
    k = RmsNorm(k, w.k_norm, o.rms_norm_eps);
  }
  q = RotatePartial(q.transpose(1, 2), rope.cos, rope.sin);  // [B, heads, T, hd]
  k = RotatePartial(k.transpose(1, 2), rope.cos, rope.sin);
  at::Tensor attn = Attend(q, k, v, segment_ids, rope.softmax_scale);
  return Linear(attn.transpose(1, 2).reshape({b, t, o.num_attention_heads * hd}), w.o_proj, {},
                w.o_lora);
}

// Queries from x (optionally through the q_a -> norm -> q_b bottleneck), keys
// and values expanded per head from one normalized latent of kv_lora_rank
// dims, plus a single rotary key of qk_rope_head_dim dims shared by all heads.
at::Tensor LatentAttention(const ModelOptions& o, const LatentWeights& w, const at::Tensor& x,
                           const RotaryTables& rope, const at::Tensor& segment_ids) {
  const int64_t b = x.size(0), t = x.size(1), heads = o.num_attention_heads;
  const int64_t nope = o.qk_nope_head_dim, rope_dim = o.qk_rope_head_dim;
  at::Tensor q =
      o.q_lora_rank > 0
          ? Linear(RmsNorm(Linear(x, w.q_a_proj, {}, w.q_a_lora), w.q_a_norm, kLatentNormEps),
                   w.q_b_proj, {}, w.q_b_lora)
          : Linear(x, w.q_proj, {}, w.q_lora);
  q = q.view({b, t, heads, nope + rope_dim}).transpose(1, 2);  // [B, heads, T, nope + rope]
  at::Tensor compressed = Linear(x, w.kv_a_proj, {}, w.kv_a_lora);  // [B, T, kv_lora_rank + rope]
  at::Tensor latent =
      RmsNorm(compressed.narrow(-1, 0, o.kv_lora_rank), w.kv_a_norm, kLatentNormEps);
  at::Tensor k_rot = compressed.narrow(-1, o.kv_lora_rank, rope_dim).view({b, 1, t, rope_dim});
  at::Tensor q_rot = Rotate(q.narrow(-1, nope, rope_dim), rope.cos, rope.sin, o.rope_interleave);
  k_rot = Rotate(k_rot, rope.cos, rope.sin, o.rope_interleave);
  at::Tensor query = at::cat({q.narrow(-1, 0, nope), q_rot}, -1);
  at::Tensor kv = Linear(latent, w.kv_b_proj, {}, w.kv_b_lora)
                      .view({b, t, heads, nope + o.v_head_dim})
                      .transpose(1, 2);  // [B, heads, T, nope + v]
  at::Tensor key = at::cat({kv.narrow(-1, 0, nope), k_rot.expand({b, heads, t, rope_dim})}, -1);
  at::Tensor value = kv.narrow(-1, nope, o.v_head_dim);
  at::Tensor attn = Attend(query, key, value, segment_ids, rope.softmax_scale);
  return Linear(attn.transpose(1, 2).reshape({b, t, heads * o.v_head_dim}), w.o_proj, {}, w.o_lora);
}

}  // namespace moefit::framework
