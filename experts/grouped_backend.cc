// The tiled, parallel CPU expert backend; see grouped_backend.h.
#include "experts/grouped_backend.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>

namespace moefit::experts {
namespace {

// A block of consecutive rows of one expert.
struct Tile {
  int64_t expert = 0;
  int64_t begin = 0;
  int64_t size = 0;
};

// Cuts each segment (segment s: counts[s] rows of expert s % num_experts)
// into blocks of at most `block` rows.
std::vector<Tile> RowTiles(const std::vector<int64_t>& counts, int64_t num_experts,
                           int64_t block) {
  std::vector<Tile> tiles;
  int64_t row = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    const int64_t e = static_cast<int64_t>(s) % num_experts;
    for (int64_t r = 0; r < counts[s]; r += block) {
      tiles.push_back({e, row + r, std::min(block, counts[s] - r)});
    }
    row += counts[s];
  }
  return tiles;
}

// Rows per tile: small enough that every thread gets several tiles, large
// enough that each GEMM runs near peak.
int64_t TileRows(int64_t num_rows, int num_threads) {
  const int64_t want = (num_rows + 4 * num_threads - 1) / (4 * num_threads);
  return std::clamp<int64_t>(want, 16, 1024);
}

// out = a · b written in place into `out` (a view into a larger buffer).
void MmInto(at::Tensor out, const at::Tensor& a, const at::Tensor& b) { at::mm_out(out, a, b); }

// Torch's own intra-op threads are set to one while the tiles run: the
// parallelism is ours, and nested MKL/oneDNN/OpenMP teams would oversubscribe.
// at::set_num_threads sets the OpenMP and MKL thread counts of the calling
// thread only, so the caller uses this guard and each arena worker makes
// itself single-threaded once (MakeWorkerSingleThreaded).
class SingleThreadedTorch {
 public:
  SingleThreadedTorch() : saved_(at::get_num_threads()) {
    if (saved_ != 1) at::set_num_threads(1);
  }
  ~SingleThreadedTorch() {
    if (saved_ != 1) at::set_num_threads(saved_);
  }

 private:
  int saved_;
};

void MakeWorkerSingleThreaded() {
  thread_local bool done = false;
  if (!done) {
    at::set_num_threads(1);
    done = true;
  }
}

// h = silu(gate) * up over one tile, with gate_up = [gate | up] per row.
template <typename T>
void SiluMul(const at::Tensor& gate_up, const at::Tensor& h) {
  using Acc = at::opmath_type<T>;
  const int64_t rows = h.size(0), inter = h.size(1);
  const T* gu = gate_up.const_data_ptr<T>();
  T* out = h.data_ptr<T>();
  for (int64_t i = 0; i < rows; ++i) {
    const T* g_row = gu + i * 2 * inter;
    const T* u_row = g_row + inter;
    T* h_row = out + i * inter;
    for (int64_t j = 0; j < inter; ++j) {
      const Acc g = static_cast<Acc>(g_row[j]);
      const Acc s = Acc(1) / (Acc(1) + std::exp(-g));
      h_row[j] = static_cast<T>(g * s * static_cast<Acc>(u_row[j]));
    }
  }
}

// Backward of SiluMul fused with recomputing h: from gate_up and dh writes
// h (needed for d down_proj) and d_gate_up = [d_gate | d_up].
template <typename T>
void SiluMulBackward(const at::Tensor& gate_up, const at::Tensor& dh, const at::Tensor& h,
                     const at::Tensor& d_gate_up) {
  using Acc = at::opmath_type<T>;
  const int64_t rows = h.size(0), inter = h.size(1);
  const T* gu = gate_up.const_data_ptr<T>();
  const T* dh_p = dh.const_data_ptr<T>();
  T* h_p = h.data_ptr<T>();
  T* dgu = d_gate_up.data_ptr<T>();
  for (int64_t i = 0; i < rows; ++i) {
    const T* g_row = gu + i * 2 * inter;
    const T* u_row = g_row + inter;
    T* dg_row = dgu + i * 2 * inter;
    T* du_row = dg_row + inter;
    for (int64_t j = 0; j < inter; ++j) {
      const Acc g = static_cast<Acc>(g_row[j]);
      const Acc u = static_cast<Acc>(u_row[j]);
      const Acc d = static_cast<Acc>(dh_p[i * inter + j]);
      const Acc s = Acc(1) / (Acc(1) + std::exp(-g));
      const Acc act = g * s;
      h_p[i * inter + j] = static_cast<T>(act * u);
      dg_row[j] = static_cast<T>(d * u * s * (Acc(1) + g * (Acc(1) - s)));
      du_row[j] = static_cast<T>(d * act);
    }
  }
}

class GroupedBackend final : public ExpertBackend {
 public:
  explicit GroupedBackend(const BackendOptions& options)
      : num_threads_(options.num_threads > 0 ? options.num_threads : at::get_num_threads()),
        arena_(num_threads_) {}

  std::string_view name() const override { return "grouped"; }

  at::Tensor Forward(const at::Tensor& x, const std::vector<int64_t>& counts,
                     const ExpertWeights& w, at::Tensor* activations) override {
    const int64_t rows = x.size(0), inter = w.down_proj.size(2);
    at::Tensor gate_up = at::empty({rows, 2 * inter}, x.options());
    at::Tensor h = at::empty({rows, inter}, x.options());
    at::Tensor y = at::empty({rows, w.down_proj.size(1)}, x.options());
    const std::vector<Tile> tiles =
        RowTiles(counts, w.gate_up_proj.size(0), TileRows(rows, num_threads_));
    RunTiles(tiles.size(), [&](size_t t) {
      const Tile& tile = tiles[t];
      at::Tensor gu_t = gate_up.narrow(0, tile.begin, tile.size);
      at::Tensor h_t = h.narrow(0, tile.begin, tile.size);
      MmInto(gu_t, x.narrow(0, tile.begin, tile.size), w.gate_up_proj[tile.expert].t());
      AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "SiluMul",
                                     [&] { SiluMul<scalar_t>(gu_t, h_t); });
      MmInto(y.narrow(0, tile.begin, tile.size), h_t, w.down_proj[tile.expert].t());
    });
    *activations = gate_up;
    return y;
  }

  ExpertGrads Backward(const at::Tensor& grad_y_in, const at::Tensor& x,
                       const std::vector<int64_t>& counts, const ExpertWeights& w,
                       const at::Tensor& activations) override {
    const int64_t rows = x.size(0), inter = w.down_proj.size(2);
    const int64_t hidden = w.down_proj.size(1);
    at::Tensor grad_y = grad_y_in.contiguous();
    at::Tensor h = at::empty({rows, inter}, x.options());
    at::Tensor dh = at::empty({rows, inter}, x.options());
    at::Tensor d_gate_up = at::empty({rows, 2 * inter}, x.options());
    ExpertGrads g;
    g.x = at::empty_like(x);
    g.gate_up_proj = at::zeros_like(w.gate_up_proj);
    g.down_proj = at::zeros_like(w.down_proj);

    // Phase 1, per row tile: dh, the fused SwiGLU derivative, dx.
    const int64_t num_experts = w.gate_up_proj.size(0);
    const std::vector<Tile> tiles = RowTiles(counts, num_experts, TileRows(rows, num_threads_));
    RunTiles(tiles.size(), [&](size_t t) {
      const Tile& tile = tiles[t];
      at::Tensor dh_t = dh.narrow(0, tile.begin, tile.size);
      at::Tensor dgu_t = d_gate_up.narrow(0, tile.begin, tile.size);
      MmInto(dh_t, grad_y.narrow(0, tile.begin, tile.size), w.down_proj[tile.expert]);
      AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "SiluMulBackward", [&] {
        SiluMulBackward<scalar_t>(activations.narrow(0, tile.begin, tile.size), dh_t,
                                  h.narrow(0, tile.begin, tile.size), dgu_t);
      });
      MmInto(g.x.narrow(0, tile.begin, tile.size), dgu_t, w.gate_up_proj[tile.expert]);
    });

    // Phase 2, per (expert, block of weight rows): dW = d_out^T · in summed
    // over the expert's segments. Splitting the output rows keeps a hot expert
    // parallel.
    std::vector<std::vector<Tile>> segments(num_experts);  // per expert: its row ranges
    int64_t row = 0;
    for (size_t s = 0; s < counts.size(); ++s) {
      if (counts[s] > 0) {
        const int64_t e = static_cast<int64_t>(s) % num_experts;
        segments[e].push_back({e, row, counts[s]});
      }
      row += counts[s];
    }
    struct WeightTile {
      bool down;  // down_proj rows (else gate_up_proj rows)
      int64_t expert, begin, size;
    };
    std::vector<WeightTile> wtiles;
    constexpr int64_t kWeightRows = 512;
    for (int64_t e = 0; e < num_experts; ++e) {
      if (segments[e].empty()) continue;
      for (int64_t r = 0; r < hidden; r += kWeightRows)
        wtiles.push_back({true, e, r, std::min(kWeightRows, hidden - r)});
      for (int64_t r = 0; r < 2 * inter; r += kWeightRows)
        wtiles.push_back({false, e, r, std::min(kWeightRows, 2 * inter - r)});
    }
    RunTiles(wtiles.size(), [&](size_t t) {
      const WeightTile& wt = wtiles[t];
      const at::Tensor& d_out = wt.down ? grad_y : d_gate_up;
      const at::Tensor& in = wt.down ? h : x;
      at::Tensor out = (wt.down ? g.down_proj : g.gate_up_proj)[wt.expert].narrow(0, wt.begin, wt.size);
      bool first = true;
      for (const Tile& seg : segments[wt.expert]) {
        at::Tensor a = d_out.narrow(0, seg.begin, seg.size).narrow(1, wt.begin, wt.size).t();
        at::Tensor b = in.narrow(0, seg.begin, seg.size);
        if (first) {
          MmInto(out, a, b);
          first = false;
        } else {
          out.addmm_(a, b);
        }
      }
    });
    return g;
  }

 private:
  template <typename Fn>
  void RunTiles(size_t num_tiles, const Fn& fn) {
    if (num_tiles == 0) return;
    SingleThreadedTorch single;
    // Workers run ATen ops: give them the caller's grad mode and dispatch
    // state (inside an autograd function, autograd must stay off there too).
    const at::ThreadLocalState state;
    arena_.execute([&] {
      tbb::parallel_for(tbb::blocked_range<size_t>(0, num_tiles, 1),
                        [&](const tbb::blocked_range<size_t>& r) {
                          at::ThreadLocalStateGuard guard(state);
                          MakeWorkerSingleThreaded();
                          for (size_t t = r.begin(); t != r.end(); ++t) fn(t);
                        });
    });
  }

  int num_threads_;
  tbb::task_arena arena_;
};

}  // namespace

std::unique_ptr<ExpertBackend> CreateGroupedBackend(const BackendOptions& options) {
  return std::make_unique<GroupedBackend>(options);
}

}  // namespace moefit::experts
