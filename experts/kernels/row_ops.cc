// Row moves over a RowRelation; see row_ops.h.
#include "experts/kernels/row_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/csrc/autograd/custom_function.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <type_traits>

#include "absl/container/inlined_vector.h"

namespace moefit::experts::kernels {
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

// to[i] = sum over c < n of w[c] * from[c][i] for i < h, in c order: a block
// of kBlock elements at a time summed over all the rows in registers and
// stored once, rather than the output read and written again per row. The
// rows are read side by side, and the groups' rows lie in runs (each local
// expert's outputs in arrival order, each rank's rows in token order), so
// the hardware prefetcher follows each run, better than prefetching the next
// group's rows by hand, which made this loop slower.
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

// out[p] = sum_j weight[p, j] * src[members[p, j]], in the accumulate type,
// where member rows [block_at, block_at + block.size(0)) are read from
// `block` (undefined: none) and src holds the others, those after the block
// moved up by its length.
at::Tensor CollectRows(const at::Tensor& src_in, const RowRelation& rel,
                       const at::Tensor& weight_in, int64_t block_at = 0,
                       const at::Tensor& block_in = {}) {
  const at::Tensor src = src_in.contiguous();
  const at::Tensor block = block_in.defined() ? block_in.contiguous() : src.narrow(0, 0, 0);
  const int64_t block_rows = block.size(0);
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
      const S* in_block = block.data_ptr<S>();
      auto row = [&](int64_t m) {
        if (m < block_at) return in + m * h;
        if (m < block_at + block_rows) return in_block + (m - block_at) * h;
        return in + (m - block_rows) * h;
      };
      A* res = out.data_ptr<A>();
      const A* wt = weight.defined() ? weight.data_ptr<A>() : nullptr;
      ForRows(p_rows, h * static_cast<int64_t>(sizeof(A)), [&](int64_t p) {
        absl::InlinedVector<const S*, 16> rows;
        absl::InlinedVector<A, 16> w;
        for (int64_t j = 0; j < f; ++j) {
          const int64_t m = members[p * f + j];
          if (m < 0) continue;
          rows.push_back(row(m));
          w.push_back(wt == nullptr ? A(1) : wt[p * f + j]);
        }
        SumRows(res + p * h, rows.data(), w.data(), static_cast<int>(rows.size()), h);
      });
    });
  });
  return out;
}

// Stores n float32 values at `to` (16-byte aligned, n a multiple of 4) with
// non-temporal stores: the lines go to memory without being read first and
// without pushing the rows being read out of the cache.
void StreamStore(float* to, const float* from, int64_t n) {
  for (int64_t i = 0; i < n; i += 4) _mm_stream_ps(to + i, _mm_loadu_ps(from + i));
}

std::atomic<int64_t> stream_above_bytes{LastLevelCacheBytes()};

// The backward of CollectRows, one group at a time. Each member m =
// members[p, j] of group p gets dsrc[m] = weight[p, j] * grad[p] (weight
// undefined: 1) in `dtype`, and where `dweight` is wanted, dweight[p, j] =
// src[m] . grad[p] (0 where there is no member). The group's gradient row is
// read from memory once for all its members, a block at a time (the other
// members read it from L1), its members' rows side by side as SumRows reads
// them. Where the new rows are more than the last-level cache holds (see
// SetStreamAboveBytes), they would be gone from it before the experts'
// backward reads them, so float32 rows are written with non-temporal stores
// (those 16-byte aligned; benchmarks/README.md has the measurement behind
// the choice). The dot products sum element i into partial sum
// i % 16 (16 interleaved sums the compiler keeps in vector lanes; one running
// sum it must keep scalar, in order), then the 16 in order.
struct CollectGrads {
  at::Tensor dsrc, dweight;
};

CollectGrads CollectBackward(const at::Tensor& grad_in, const RowRelation& rel,
                             const at::Tensor& weight_in, const at::Tensor& src_in,
                             at::ScalarType dtype, bool want_dweight) {
  const int64_t h = grad_in.size(1), p_rows = rel.members.size(0), f = rel.members.size(1);
  const int64_t m_rows = rel.slot.size(0);
  const at::ScalarType acc = AccumulateType(grad_in.scalar_type(), dtype);
  const at::Tensor grad = grad_in.to(acc).contiguous();
  const at::Tensor weight = weight_in.defined() ? weight_in.to(acc).contiguous() : weight_in;
  const at::Tensor src = want_dweight ? src_in.contiguous() : src_in;
  CollectGrads out;
  out.dsrc = at::empty({m_rows, h}, grad.options().dtype(dtype));
  if (want_dweight) out.dweight = at::empty({p_rows, f}, grad.options());
  const int64_t* members = rel.members.data_ptr<int64_t>();
  WithType(dtype, [&](auto o) {
    WithType(acc, [&](auto a) {
      using O = decltype(o);  // dsrc, and src (which has the same dtype)
      using A = decltype(a);
      constexpr int kLanes = 16;
      constexpr int64_t kBlock = 64;  // elements per block: a multiple of kLanes
      const A* g = grad.data_ptr<A>();
      const A* wt = weight.defined() ? weight.data_ptr<A>() : nullptr;
      const O* in = want_dweight ? src.data_ptr<O>() : nullptr;
      O* ds = out.dsrc.data_ptr<O>();
      const bool stream = static_cast<int64_t>(out.dsrc.nbytes()) > stream_above_bytes.load();
      A* dw = want_dweight ? out.dweight.data_ptr<A>() : nullptr;
      ForRows(p_rows, h * static_cast<int64_t>(sizeof(A)), [&](int64_t p) {
        absl::InlinedVector<int64_t, 16> slot;  // j of each present member
        absl::InlinedVector<O*, 16> to;
        absl::InlinedVector<const O*, 16> from;
        absl::InlinedVector<A, 16> w;
        for (int64_t j = 0; j < f; ++j) {
          const int64_t m = members[p * f + j];
          if (m < 0) {
            if (dw != nullptr) dw[p * f + j] = A(0);
            continue;
          }
          slot.push_back(j);
          to.push_back(ds + m * h);
          if (in != nullptr) from.push_back(in + m * h);
          w.push_back(wt == nullptr ? A(1) : wt[p * f + j]);
        }
        const int n = static_cast<int>(slot.size());
        if (n == 0) return;
        absl::InlinedVector<std::array<A, kLanes>, 16> part(n, std::array<A, kLanes>{});
        const A* gp = g + p * h;
        int64_t i0 = 0;
        for (; i0 + kBlock <= h; i0 += kBlock) {
          for (int c = 0; c < n; ++c) {
            A scaled[kBlock];
            for (int64_t i = 0; i < kBlock; ++i) scaled[i] = w[c] * gp[i0 + i];
            O* t = to[c] + i0;
            if constexpr (std::is_same_v<O, float> && std::is_same_v<A, float>) {
              if (stream && reinterpret_cast<uintptr_t>(t) % 16 == 0) {
                StreamStore(t, scaled, kBlock);
              } else {
                std::memcpy(t, scaled, sizeof(scaled));
              }
            } else {
              for (int64_t i = 0; i < kBlock; ++i) t[i] = static_cast<O>(scaled[i]);
            }
            if (dw == nullptr) continue;
            const O* r = from[c] + i0;
            A* lanes = part[c].data();
            for (int64_t k = 0; k < kBlock; k += kLanes) {
              for (int l = 0; l < kLanes; ++l) {
                lanes[l] += static_cast<A>(r[k + l]) * gp[i0 + k + l];
              }
            }
          }
        }
        for (int c = 0; c < n; ++c) {
          for (int64_t i = i0; i < h; ++i) {
            to[c][i] = static_cast<O>(w[c] * gp[i]);
            if (dw != nullptr) part[c][i % kLanes] += static_cast<A>(from[c][i]) * gp[i];
          }
          if (dw == nullptr) continue;
          A sum = 0;
          for (A v : part[c]) sum += v;
          dw[p * f + slot[c]] = sum;
        }
        if (stream) _mm_sfence();  // the streamed rows, ordered before what follows
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
    const bool want_dweight = weight.defined() && ctx->needs_input_grad(1);
    CollectGrads g = CollectBackward(grads[0], rel, weight, src, dtype, want_dweight);
    if (want_dweight) g.dweight = g.dweight.to(weight.scalar_type());
    return {g.dsrc, g.dweight, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

int64_t LastLevelCacheBytes() {
  int64_t bytes = 0;
  int top = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level_file(dir + "level"), size_file(dir + "size");
    int level = 0;
    std::string size;
    if (!(level_file >> level) || !(size_file >> size)) break;
    char* unit = nullptr;
    int64_t v = std::strtoll(size.c_str(), &unit, 10);
    if (*unit == 'K') v <<= 10;
    if (*unit == 'M') v <<= 20;
    if (level >= top && v > 0) {
      top = level;
      bytes = v;
    }
  }
  if (bytes > 0) return bytes;
  for (const int name : {_SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
    const long v = sysconf(name);
    if (v > 0) return static_cast<int64_t>(v);
  }
  return int64_t{32} << 20;
}

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

at::Tensor SumAroundBlock(const at::Tensor& src, int64_t block_at, const at::Tensor& block,
                          const RowRelation& relation) {
  TORCH_CHECK(src.dim() == 2 && block.dim() == 2 && src.size(1) == block.size(1) &&
                  src.scalar_type() == block.scalar_type(),
              "SumAroundBlock: src and block must be [*, H] of one dtype, not ", src.sizes(), " ",
              src.scalar_type(), " and ", block.sizes(), " ", block.scalar_type());
  TORCH_CHECK(src.size(0) + block.size(0) == relation.slot.size(0) && block_at >= 0 &&
                  block_at <= src.size(0),
              "SumAroundBlock: ", src.size(0), " + ", block.size(0), " rows with the block at ",
              block_at, " for ", relation.slot.size(0), " members");
  return CollectRows(src, relation, at::Tensor(), block_at, block);
}

int64_t SetStreamAboveBytes(int64_t bytes) { return stream_above_bytes.exchange(bytes); }

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

}  // namespace moefit::experts::kernels
