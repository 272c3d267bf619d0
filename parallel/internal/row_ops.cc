// Row moves over a RowRelation; see row_ops.h.
#include "parallel/internal/row_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "absl/container/inlined_vector.h"

namespace moefit::parallel::internal {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Calls fn with a value of the C++ type of `t` (float32, float64, bfloat16).
template <typename Fn>
void WithType(at::ScalarType t, Fn&& fn) {
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, t, "row move", [&] { fn(scalar_t{}); });
}

// What a row move sums in: float32, or float64 when either side is.
at::ScalarType AccumulateType(at::ScalarType a, at::ScalarType b) {
  return at::promote_types(at::promote_types(a, b), at::kFloat);
}

// Rows [0, n) in parallel on LibTorch's intra-op threads (the ones its ops
// around these moves use: a second pool would compete with them for the
// cores), in blocks of about 64 KiB.
template <typename Fn>
void ForRows(int64_t n, int64_t row_bytes, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

// The rows a group sums lie anywhere in src, each a few pages long: the
// hardware prefetcher starts over on every new page and row, and a read at
// memory speed needs the next rows on their way before the current ones end.
// So while group p's members are read, one cache line at a time, the same
// lines of group p + 1's members are prefetched: p's c-th present member (of
// n) takes p + 1's members c, c + n, c + 2n, ... (in either group the
// members may sit in any of the f slots).
template <typename S>
class NextRows {
 public:
  static constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(S));

  // Counts group p's present members and finds group p + 1's rows (none
  // for the last group; the first kMaxRows: beyond them only the prefetch
  // is lost).
  NextRows(const int64_t* members, int64_t p, int64_t groups, int64_t f, const S* src, int64_t h) {
    for (int64_t j = 0; j < f; ++j) present_ += members[p * f + j] >= 0;
    if (p + 1 >= groups) return;
    for (int64_t j = 0; j < f && num_rows_ < kMaxRows; ++j) {
      const int64_t m = members[(p + 1) * f + j];
      if (m >= 0) rows_[num_rows_++] = src + m * h;
    }
  }
  // Prefetches the line at element i of the next rows assigned to member c.
  void Fetch(int c, int64_t i) const {
    for (int q = c; q < num_rows_; q += present_) __builtin_prefetch(rows_[q] + i);
  }

 private:
  static constexpr int kMaxRows = 64;
  const S* rows_[kMaxRows];
  int num_rows_ = 0, present_ = 0;
};

// out[m] = scale[slot[m]] * src[slot[m] / f] (scale undefined: 1), in `dtype`,
// one cache line at a time with the next member's source row prefetched (see
// NextRows).
at::Tensor SpreadRows(const at::Tensor& src_in, const RowRelation& rel, const at::Tensor& scale_in,
                      at::ScalarType dtype) {
  const at::Tensor src = src_in.contiguous();
  const int64_t h = src.size(1), f = rel.members.size(1), m_rows = rel.slot.size(0);
  at::Tensor out = at::empty({m_rows, h}, src.options().dtype(dtype));
  const int64_t* slot = rel.slot.data_ptr<int64_t>();
  const at::ScalarType acc = AccumulateType(src.scalar_type(), dtype);
  const at::Tensor scale = scale_in.defined() ? scale_in.to(acc).contiguous() : scale_in;
  WithType(src.scalar_type(), [&](auto s) {
    WithType(dtype, [&](auto o) {
      WithType(acc, [&](auto a) {
        using S = decltype(s);
        using O = decltype(o);
        using A = decltype(a);
        const S* in = src.data_ptr<S>();
        O* res = out.data_ptr<O>();
        const A* sc = scale.defined() ? scale.data_ptr<A>() : nullptr;
        ForRows(m_rows, h * static_cast<int64_t>(sizeof(O)), [&](int64_t m) {
          const S* from = in + (slot[m] / f) * h;
          const S* ahead = m + 1 < m_rows ? in + (slot[m + 1] / f) * h : nullptr;
          O* to = res + m * h;
          constexpr int64_t kLine = NextRows<S>::kLine;
          const A w = sc == nullptr ? A(1) : sc[slot[m]];
          for (int64_t i0 = 0; i0 < h; i0 += kLine) {
            if (ahead != nullptr) __builtin_prefetch(ahead + i0);
            const int64_t end = std::min(h, i0 + kLine);
            if (sc == nullptr && std::is_same_v<S, O>) {
              if (end - i0 == kLine) {  // a constant size: inlined as vector moves
                std::memcpy(to + i0, from + i0, kLine * sizeof(O));
              } else {
                std::memcpy(to + i0, from + i0, (end - i0) * sizeof(O));
              }
            } else {
              for (int64_t i = i0; i < end; ++i)
                to[i] = static_cast<O>(w * static_cast<A>(from[i]));
            }
          }
        });
      });
    });
  });
  return out;
}

// to[i] = sum over c < n of w[c] * from[c][i] for i < h, in c order: a block
// of kBlock elements at a time summed over all the rows in registers and
// stored once, rather than the output read and written again per row. The
// rows are read side by side, and the groups' rows lie in runs (each local
// expert's outputs in arrival order, each rank's rows in token order), so
// the hardware prefetcher follows each run; prefetching the next group's
// rows by hand, as the row-at-a-time sums below do, made this loop slower
// (a 2-core AMD EPYC, Zen 4: 9-13 GB/s read against 15-18 alone, and
// dispatch_bench's combine sums 24-26 ms against 37-39 row at a time).
template <typename S, typename A>
void SumRows(A* to, const S* const* from, const A* w, int n, int64_t h) {
  constexpr int64_t kBlock = 256 / static_cast<int64_t>(sizeof(S));
  if (n == 0) {
    std::fill(to, to + h, A(0));
    return;
  }
  int64_t i0 = 0;
  if constexpr (std::is_same_v<S, float> && std::is_same_v<A, float>) {
    // float32: 32 values at a time in eight 4-lane vectors (the build's
    // baseline registers), the same products and sums in the same order as
    // the loops below.
    typedef float V4 __attribute__((vector_size(16)));
    auto load = [](const float* p) {
      V4 v;
      std::memcpy(&v, p, sizeof(v));  // unaligned: rows start anywhere
      return v;
    };
    constexpr int kV = 8;
    for (; i0 + 4 * kV <= h; i0 += 4 * kV) {
      V4 acc[kV];
      for (int v = 0; v < kV; ++v) acc[v] = w[0] * load(from[0] + i0 + 4 * v);
      for (int c = 1; c < n; ++c) {
        for (int v = 0; v < kV; ++v) acc[v] += w[c] * load(from[c] + i0 + 4 * v);
      }
      std::memcpy(to + i0, acc, sizeof(acc));
    }
  }
  for (; i0 + kBlock <= h; i0 += kBlock) {
    A acc[kBlock];
    for (int64_t i = 0; i < kBlock; ++i) acc[i] = w[0] * static_cast<A>(from[0][i0 + i]);
    for (int c = 1; c < n; ++c) {
      const S* row = from[c] + i0;
      const A wc = w[c];
      for (int64_t i = 0; i < kBlock; ++i) acc[i] += wc * static_cast<A>(row[i]);
    }
    std::memcpy(to + i0, acc, sizeof(acc));
  }
  for (int64_t i = i0; i < h; ++i) {
    A sum = w[0] * static_cast<A>(from[0][i]);
    for (int c = 1; c < n; ++c) sum += w[c] * static_cast<A>(from[c][i]);
    to[i] = sum;
  }
}

// out[p] = sum_j weight[p, j] * src[members[p, j]], in the accumulate type.
at::Tensor CollectRows(const at::Tensor& src_in, const RowRelation& rel,
                       const at::Tensor& weight_in) {
  const at::Tensor src = src_in.contiguous();
  const int64_t h = src.size(1), p_rows = rel.members.size(0), f = rel.members.size(1);
  const at::ScalarType acc = AccumulateType(src.scalar_type(), at::kFloat);
  at::Tensor out = at::empty({p_rows, h}, src.options().dtype(acc));
  const int64_t* members = rel.members.data_ptr<int64_t>();
  const at::Tensor weight = weight_in.defined() ? weight_in.to(acc).contiguous() : weight_in;
  WithType(src.scalar_type(), [&](auto s) {
    WithType(acc, [&](auto a) {
      using S = decltype(s);
      using A = decltype(a);
      const S* in = src.data_ptr<S>();
      A* res = out.data_ptr<A>();
      const A* wt = weight.defined() ? weight.data_ptr<A>() : nullptr;
      ForRows(p_rows, h * static_cast<int64_t>(sizeof(A)), [&](int64_t p) {
        absl::InlinedVector<const S*, 16> rows;
        absl::InlinedVector<A, 16> w;
        for (int64_t j = 0; j < f; ++j) {
          const int64_t m = members[p * f + j];
          if (m < 0) continue;
          rows.push_back(in + m * h);
          w.push_back(wt == nullptr ? A(1) : wt[p * f + j]);
        }
        SumRows(res + p * h, rows.data(), w.data(), static_cast<int>(rows.size()), h);
      });
    });
  });
  return out;
}

// Sum over i < n of a[i] * b[i] in A, in 16 interleaved partial sums (which
// the compiler turns into vector lanes; a single running sum it must keep
// scalar, in order). a is member c of its group, prefetching for it from
// `next`.
template <typename S, typename A>
A DotRow(const S* a, const A* b, int64_t n, const NextRows<S>& next, int c) {
  constexpr int kLanes = 16;
  A part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    constexpr int64_t kLine = NextRows<S>::kLine;
    for (int64_t l = 0; l < kLanes; l += kLine) {  // once where a line holds kLanes
      if ((i + l) % kLine == 0) next.Fetch(c, i + l);
    }
    for (int l = 0; l < kLanes; ++l) part[l] += static_cast<A>(a[i + l]) * b[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) part[l] += static_cast<A>(a[i]) * b[i];
  A sum = 0;
  for (A v : part) sum += v;
  return sum;
}

// dweight[p, j] = src[members[p, j]] . grad[p] (0 where there is no member).
at::Tensor WeightGrad(const at::Tensor& src_in, const RowRelation& rel, const at::Tensor& grad_in) {
  const at::Tensor src = src_in.contiguous();
  const int64_t h = src.size(1), p_rows = rel.members.size(0), f = rel.members.size(1);
  const at::ScalarType acc = AccumulateType(src.scalar_type(), grad_in.scalar_type());
  const at::Tensor grad = grad_in.to(acc).contiguous();
  at::Tensor out = at::empty({p_rows, f}, grad.options());
  const int64_t* members = rel.members.data_ptr<int64_t>();
  WithType(src.scalar_type(), [&](auto s) {
    WithType(acc, [&](auto a) {
      using S = decltype(s);
      using A = decltype(a);
      const S* in = src.data_ptr<S>();
      const A* g = grad.data_ptr<A>();
      A* res = out.data_ptr<A>();
      ForRows(p_rows, h * static_cast<int64_t>(sizeof(A)), [&](int64_t p) {
        const NextRows<S> next(members, p, p_rows, f, in, h);
        int c = 0;
        for (int64_t j = 0; j < f; ++j) {
          const int64_t m = members[p * f + j];
          res[p * f + j] = m < 0 ? A(0) : DotRow(in + m * h, g + p * h, h, next, c++);
        }
      });
    });
  });
  return out;
}

RowRelation Unpack(AutogradContext* ctx) {
  return {ctx->saved_data["members"].toTensor(), ctx->saved_data["slot"].toTensor()};
}

void Pack(AutogradContext* ctx, const RowRelation& rel) {
  ctx->saved_data["members"] = rel.members;
  ctx->saved_data["slot"] = rel.slot;
}

class CollectFn : public torch::autograd::Function<CollectFn> {
 public:
  // An empty `weight_or_empty` stands for weights of 1 (autograd takes no
  // undefined inputs).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& src,
                            const at::Tensor& weight_or_empty, const at::Tensor& members,
                            const at::Tensor& slot) {
    const at::Tensor weight = weight_or_empty.numel() == 0 ? at::Tensor() : weight_or_empty;
    const RowRelation rel{members, slot};
    Pack(ctx, rel);
    ctx->saved_data["dtype"] = static_cast<int64_t>(src.scalar_type());
    ctx->save_for_backward({weight.defined() ? src : at::Tensor(), weight});
    return CollectRows(src, rel, weight);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const RowRelation rel = Unpack(ctx);
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& src = saved[0];
    const at::Tensor& weight = saved[1];
    at::Tensor dsrc = SpreadRows(grads[0], rel, weight, dtype);
    at::Tensor dweight;
    if (weight.defined() && ctx->needs_input_grad(1)) {
      dweight = WeightGrad(src, rel, grads[0]).to(weight.scalar_type());
    }
    return {dsrc, dweight, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

RowRelation MakeRowRelation(at::Tensor members, int64_t num_members) {
  TORCH_CHECK(members.dim() == 2 && members.scalar_type() == at::kLong && members.is_cpu(),
              "a row relation's members must be [groups, f] int64 on the host");
  members = members.contiguous();
  at::Tensor slot = at::full({num_members}, -1, at::kLong);
  const int64_t* mp = members.data_ptr<int64_t>();
  int64_t* sp = slot.data_ptr<int64_t>();
  int64_t seen = 0;
  for (int64_t i = 0; i < members.numel(); ++i) {
    if (mp[i] < 0) continue;
    TORCH_CHECK(mp[i] < num_members && sp[mp[i]] < 0, "row relation: member ", mp[i],
                " is outside [0, ", num_members, ") or in two groups");
    sp[mp[i]] = i;
    ++seen;
  }
  TORCH_CHECK(seen == num_members, "row relation: ", num_members - seen, " of ", num_members,
              " members belong to no group");
  return {std::move(members), std::move(slot)};
}

at::Tensor GroupOf(const RowRelation& relation) {
  return at::div(relation.slot, relation.members.size(1), "floor");
}

at::Tensor Collect(const at::Tensor& src, const RowRelation& relation, const at::Tensor& weight) {
  TORCH_CHECK(src.dim() == 2 && src.size(0) == relation.slot.size(0), "Collect: src must be [",
              relation.slot.size(0), ", H], not ", src.sizes());
  TORCH_CHECK(!weight.defined() || weight.sizes() == relation.members.sizes(),
              "Collect: weight must be ", relation.members.sizes(), ", not ", weight.sizes());
  return CollectFn::apply(src, weight.defined() ? weight : at::empty({0}, src.options()),
                          relation.members, relation.slot);
}

}  // namespace moefit::parallel::internal
