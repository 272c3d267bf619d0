// Autograd glue for the expert backends; see expert_function.h.
#include "experts/expert_function.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <numeric>
#include <optional>
#include <vector>

#include "experts/kernels/row_ops.h"

namespace moefit::experts {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<int64_t> compute_ns{0};

// Adds the lifetime of the object to compute_ns.
class ComputeTimer {
 public:
  ComputeTimer() : start_(std::chrono::steady_clock::now()) {}
  ~ComputeTimer() {
    compute_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - start_)
                      .count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

// Inputs: x, the base weights, the four LoRA tensors (empty optionals where
// there is no adapter: autograd takes no undefined tensor as an input), the
// compute weights and their FP8 block scales or int4 group scales and zero
// points (optionals too), then the non-tensor arguments.
class ExpertFfnFunction : public torch::autograd::Function<ExpertFfnFunction> {
 public:
  using Lora = std::optional<at::Tensor>;

  // `gate_up_in` / `down_in` receive the base gradients (the compute weights
  // themselves, or their float32 masters); the backend computes with
  // gate_up_proj / down_proj.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& gate_up_in,
                            const at::Tensor& down_in, const Lora& gate_up_a, const Lora& gate_up_b,
                            const Lora& down_a, const Lora& down_b, at::Tensor gate_up_proj,
                            at::Tensor down_proj, const Lora& gate_up_scale, const Lora& down_scale,
                            const Lora& gate_up_zero_point, const Lora& down_zero_point,
                            int64_t int4_group_size, double scaling, ExpertBackend* backend,
                            const std::vector<int64_t>& counts, bool recompute,
                            bool base_weight_grads, const Lora& row_index_opt,
                            const Lora& row_copies_opt) {
    ComputeTimer timer;
    auto get = [](const Lora& t) { return t.has_value() ? *t : at::Tensor(); };
    ctx->saved_data["master_dtype"] = static_cast<int64_t>(gate_up_in.scalar_type());
    const ExpertWeights w{
        gate_up_proj,
        down_proj,
        ExpertLora{get(gate_up_a), get(gate_up_b), get(down_a), get(down_b), scaling},
        get(gate_up_scale),
        get(down_scale),
        get(gate_up_zero_point),
        get(down_zero_point),
        int4_group_size};
    at::Tensor activations;
    const at::Tensor row_index = get(row_index_opt), row_copies = get(row_copies_opt);
    at::Tensor y = backend->Forward(x, row_index, counts, w, recompute ? nullptr : &activations);
    ctx->save_for_backward({x, gate_up_proj, down_proj, w.lora.gate_up_a, w.lora.gate_up_b,
                            w.lora.down_a, w.lora.down_b, activations, w.gate_up_scale,
                            w.down_scale, w.gate_up_zero_point, w.down_zero_point});
    ctx->saved_data["int4_group_size"] = int4_group_size;
    ctx->saved_data["backend"] = reinterpret_cast<int64_t>(backend);
    ctx->saved_data["counts"] = counts;
    ctx->saved_data["scaling"] = scaling;
    ctx->saved_data["base_weight_grads"] = base_weight_grads;
    ctx->saved_data["row_index"] = row_index;
    ctx->saved_data["row_copies"] = row_copies;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    ComputeTimer timer;
    const variable_list saved = ctx->get_saved_variables();
    auto* backend = reinterpret_cast<ExpertBackend*>(ctx->saved_data["backend"].toInt());
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    const ExpertWeights w{
        saved[1],
        saved[2],
        ExpertLora{saved[3], saved[4], saved[5], saved[6], ctx->saved_data["scaling"].toDouble()},
        saved[8],
        saved[9],
        saved[10],
        saved[11],
        ctx->saved_data["int4_group_size"].toInt()};
    BackwardOptions options;
    options.base_weight_grads = ctx->saved_data["base_weight_grads"].toBool();
    const at::Tensor row_index = ctx->saved_data["row_index"].toTensor();
    const at::Tensor row_copies = ctx->saved_data["row_copies"].toTensor();
    ExpertGrads g = backend->Backward(grad_outputs[0].to(saved[0].scalar_type()), saved[0],
                                      row_index, counts, w, saved[7], options);
    if (row_index.defined()) g.x = internal::SumCopies(g.x, row_copies);
    const auto master = static_cast<at::ScalarType>(ctx->saved_data["master_dtype"].toInt());
    auto to_master = [&](const at::Tensor& t) { return t.defined() ? t.to(master) : t; };
    return {g.x,
            to_master(g.gate_up_proj),
            to_master(g.down_proj),
            g.gate_up_a,
            g.gate_up_b,
            g.down_a,
            g.down_b,
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

// Checks one LoRA pair against the base weights: a [E, r, in], b [E, out, r].
void CheckLoraPair(const char* name, const at::Tensor& a, const at::Tensor& b, int64_t experts,
                   int64_t in, int64_t out, const at::Tensor& base) {
  TORCH_CHECK(a.defined() == b.defined(), "LoRA ", name, "_a and ", name,
              "_b must be given together");
  if (!a.defined()) return;
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3, "LoRA ", name, "_a must be [E, r, ", in, "] and ", name,
              "_b [E, ", out, ", r]; got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.size(0) == experts && b.size(0) == experts, "LoRA ", name, " has ", a.size(0),
              " and ", b.size(0), " experts, the base weights ", experts);
  TORCH_CHECK(a.size(1) > 0 && a.size(1) == b.size(2), "LoRA ", name, " rank disagrees: ", name,
              "_a ", a.sizes(), ", ", name, "_b ", b.sizes());
  TORCH_CHECK(a.size(2) == in && b.size(1) == out, "LoRA ", name, "_a must be [E, r, ", in,
              "] and ", name, "_b [E, ", out, ", r]; got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(at::isFloatingType(a.scalar_type()) && a.scalar_type() == b.scalar_type(), "LoRA ",
              name, " tensors must share a floating dtype; got ", a.scalar_type(), " and ",
              b.scalar_type());
  TORCH_CHECK(a.scalar_type() == at::kFloat ||
                  (a.scalar_type() == at::kDouble && base.scalar_type() == at::kDouble),
              "LoRA ", name, " must be float32 (or float64 with a float64 base); got ",
              a.scalar_type(), " with a ", base.scalar_type(), " base");
  TORCH_CHECK(a.device() == base.device() && b.device() == base.device(), "LoRA ", name,
              " must be on the base weights' device ", base.device());
}

}  // namespace

double ExpertComputeSeconds() { return static_cast<double>(compute_ns.load()) * 1e-9; }

at::Tensor ExpertFfn(ExpertBackend& backend, const at::Tensor& x,
                     const std::vector<int64_t>& counts, const ExpertWeights& weights,
                     const ExpertFfnOptions& options) {
  const at::Tensor& gate_up_proj = weights.gate_up_proj;
  const at::Tensor& down_proj = weights.down_proj;
  TORCH_CHECK(x.dim() == 2 && gate_up_proj.dim() == 3 && down_proj.dim() == 3,
              "expert inputs: x [A, H], gate_up_proj [E, 2I, H], down_proj [E, H, I]");
  TORCH_CHECK(
      gate_up_proj.size(0) > 0 && static_cast<int64_t>(counts.size()) % gate_up_proj.size(0) == 0,
      "counts has ", counts.size(), " segments, not a multiple of the weights' ",
      gate_up_proj.size(0), " experts");
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const at::Tensor& row_index = options.row_index;
  const at::Tensor& row_copies = options.row_copies;
  TORCH_CHECK(row_index.defined() == row_copies.defined(),
              "expert rows by index: give both row_index and row_copies, or neither");
  if (row_index.defined()) {
    TORCH_CHECK(row_index.dim() == 1 && row_index.scalar_type() == at::kLong &&
                    row_copies.dim() == 2 && row_copies.scalar_type() == at::kLong &&
                    row_index.is_cpu() && row_copies.is_cpu(),
                "expert rows by index: row_index must be [A] and row_copies [R, f], int64 on "
                "the host");
    TORCH_CHECK(row_index.size(0) == total && row_copies.size(0) == x.size(0),
                "expert rows by index: counts sum to ", total, ", row_index has ",
                row_index.size(0), " rows, row_copies ", row_copies.size(0), " and x ", x.size(0));
    TORCH_CHECK(total == 0 || (row_index.min().item<int64_t>() >= 0 &&
                               row_index.max().item<int64_t>() < x.size(0)),
                "expert rows by index: row_index points outside x's ", x.size(0), " rows");
    // Every computation row listed exactly once, under the row it reads.
    const at::Tensor listed = row_copies.reshape({-1});
    const at::Tensor present = listed.ge(0);
    const at::Tensor members = listed.masked_select(present);
    const at::Tensor owners = at::arange(row_copies.size(0), at::kLong)
                                  .repeat_interleave(row_copies.size(1))
                                  .masked_select(present);
    TORCH_CHECK(members.numel() == total &&
                    (listed.numel() == 0 || listed.min().item<int64_t>() >= -1) &&
                    (total == 0 || (members.max().item<int64_t>() < total &&
                                    at::bincount(members, {}, total).eq(1).all().item<bool>() &&
                                    at::equal(row_index.index_select(0, members), owners))),
                "expert rows by index: row_copies must list each of the ", total,
                " computation rows once, under the row of x it reads");
  } else {
    TORCH_CHECK(total == x.size(0), "counts sum to ", total, " but x has ", x.size(0), " rows");
  }
  const bool fp8 = gate_up_proj.scalar_type() == at::kFloat8_e4m3fn;
  const bool int4 = weights.int4();
  TORCH_CHECK(gate_up_proj.scalar_type() == down_proj.scalar_type(),
              "expert weights gate_up_proj and down_proj must share a dtype; got ",
              gate_up_proj.scalar_type(), " and ", down_proj.scalar_type());
  TORCH_CHECK(fp8 || int4 ? (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16)
                          : x.scalar_type() == gate_up_proj.scalar_type(),
              "expert input ", x.scalar_type(), " does not suit weights of ",
              gate_up_proj.scalar_type(),
              " (the same dtype, or float32/bfloat16 with float8_e4m3fn or int4 weights)");
  if (fp8) {
    auto blocks = [](int64_t n) { return (n + 127) / 128; };
    const at::Tensor& gs = weights.gate_up_scale;
    const at::Tensor& ds = weights.down_scale;
    TORCH_CHECK(gs.defined() && ds.defined() && gs.scalar_type() == at::kFloat &&
                    ds.scalar_type() == at::kFloat && gs.is_contiguous() && ds.is_contiguous(),
                "float8_e4m3fn expert weights need contiguous float32 block scales");
    TORCH_CHECK(gs.sizes() == at::IntArrayRef({gate_up_proj.size(0), blocks(gate_up_proj.size(1)),
                                               blocks(gate_up_proj.size(2))}) &&
                    ds.sizes() == at::IntArrayRef({down_proj.size(0), blocks(down_proj.size(1)),
                                                   blocks(down_proj.size(2))}),
                "FP8 block scales must be one per 128 x 128 block: got ", gs.sizes(), " for ",
                gate_up_proj.sizes(), " and ", ds.sizes(), " for ", down_proj.sizes());
    TORCH_CHECK(!options.gate_up_master.defined() && !gate_up_proj.requires_grad() &&
                    !down_proj.requires_grad(),
                "float8_e4m3fn expert weights are frozen: they take no gradient");
  }
  if (int4) {
    const int64_t h = down_proj.size(1), i = gate_up_proj.size(1) / 2;
    const int64_t g = weights.int4_group_size;
    TORCH_CHECK(gate_up_proj.size(0) == down_proj.size(0) && gate_up_proj.size(1) % 2 == 0 &&
                    gate_up_proj.size(2) == Int4RowBytes(h) &&
                    down_proj.size(2) == Int4RowBytes(i) && x.size(1) == h,
                "int4 expert weight shapes disagree: gate_up_proj ", gate_up_proj.sizes(),
                " (want [E, 2I, ceil(H / 8) * 4]), down_proj ", down_proj.sizes(),
                " (want [E, H, ceil(I / 8) * 4]), x ", x.sizes());
    TORCH_CHECK(g > 0 && g % 2 == 0, "int4 experts need an even group size; got ", g);
    const at::Tensor& gs = weights.gate_up_scale;
    const at::Tensor& ds = weights.down_scale;
    auto groups = [&](int64_t n) { return (n + g - 1) / g; };
    TORCH_CHECK(gs.defined() && ds.defined() && gs.scalar_type() == at::kBFloat16 &&
                    ds.scalar_type() == at::kBFloat16 && gs.is_contiguous() && ds.is_contiguous() &&
                    gs.sizes() == at::IntArrayRef({gate_up_proj.size(0), 2 * i, groups(h)}) &&
                    ds.sizes() == at::IntArrayRef({down_proj.size(0), h, groups(i)}),
                "int4 expert weights need contiguous bfloat16 scales, one per ", g,
                " inputs of a row: got ", gs.defined() ? gs.sizes() : at::IntArrayRef{}, " and ",
                ds.defined() ? ds.sizes() : at::IntArrayRef{}, " for H ", h, " and I ", i);
    const at::Tensor& gz = weights.gate_up_zero_point;
    const at::Tensor& dz = weights.down_zero_point;
    TORCH_CHECK(
        gz.defined() == dz.defined() &&
            (!gz.defined() || (gz.scalar_type() == at::kChar && dz.scalar_type() == at::kChar &&
                               gz.sizes() == gs.sizes() && dz.sizes() == ds.sizes() &&
                               gz.is_contiguous() && dz.is_contiguous())),
        "int4 zero points: both or neither, contiguous int8 shaped as the scales");
    TORCH_CHECK(!options.gate_up_master.defined() && !gate_up_proj.requires_grad() &&
                    !down_proj.requires_grad(),
                "int4 expert weights are frozen: they take no gradient");
  } else {
    TORCH_CHECK(gate_up_proj.size(0) == down_proj.size(0) &&
                    gate_up_proj.size(1) == 2 * down_proj.size(2) &&
                    gate_up_proj.size(2) == down_proj.size(1) && x.size(1) == down_proj.size(1),
                "expert weight shapes disagree: gate_up_proj ", gate_up_proj.sizes(),
                ", down_proj ", down_proj.sizes(), ", x ", x.sizes());
  }
  const ExpertLora& lora = weights.lora;
  const int64_t experts = gate_up_proj.size(0), hidden = weights.hidden();
  const int64_t inter = weights.intermediate();
  CheckLoraPair("gate_up", lora.gate_up_a, lora.gate_up_b, experts, hidden, 2 * inter,
                gate_up_proj);
  CheckLoraPair("down", lora.down_a, lora.down_b, experts, inter, hidden, down_proj);
  TORCH_CHECK(!lora.has_gate_up() || !lora.has_down() ||
                  lora.gate_up_a.scalar_type() == lora.down_a.scalar_type(),
              "LoRA gate_up and down tensors must share a dtype");
  TORCH_CHECK(std::isfinite(lora.scaling), "LoRA scaling must be finite");
  const bool masters = options.gate_up_master.defined();
  TORCH_CHECK(masters == options.down_master.defined(),
              "expert master weights: give both gate_up_master and down_master, or neither");
  if (masters) {
    TORCH_CHECK(options.gate_up_master.sizes() == gate_up_proj.sizes() &&
                    options.down_master.sizes() == down_proj.sizes() &&
                    options.gate_up_master.scalar_type() == at::kFloat &&
                    options.down_master.scalar_type() == at::kFloat,
                "expert master weights must be float32 and shaped as the compute weights; got ",
                options.gate_up_master.sizes(), " and ", options.down_master.sizes());
  }
  const at::Tensor& gate_up_in = masters ? options.gate_up_master : gate_up_proj;
  const at::Tensor& down_in = masters ? options.down_master : down_proj;
  const bool base_weight_grads = gate_up_in.requires_grad() || down_in.requires_grad();
  auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional(t) : std::nullopt; };
  // The compute weights travel as data, not as differentiable inputs.
  return ExpertFfnFunction::apply(
      x.contiguous(), gate_up_in, down_in, opt(lora.gate_up_a), opt(lora.gate_up_b),
      opt(lora.down_a), opt(lora.down_b), gate_up_proj.detach(), down_proj.detach(),
      opt(weights.gate_up_scale), opt(weights.down_scale), opt(weights.gate_up_zero_point),
      opt(weights.down_zero_point), weights.int4_group_size, lora.scaling, &backend, counts,
      options.recompute, base_weight_grads, opt(row_index), opt(row_copies));
}

at::Tensor ExpertFfn(ExpertBackend& backend, const at::Tensor& x,
                     const std::vector<int64_t>& counts, const at::Tensor& gate_up_proj,
                     const at::Tensor& down_proj) {
  return ExpertFfn(backend, x, counts, ExpertWeights{gate_up_proj, down_proj});
}

namespace internal {

// Each row's copies are the members of its group in the relation the
// dispatchers' Collect sums (kernels/row_ops.h), unweighted: the
// same side-by-side sum in j order, in float32 (float64 for float64 rows),
// rounded once here. expert_layer_bench times it against LibTorch's index_add
// of the same rows (its copies/ lines).
at::Tensor SumCopies(const at::Tensor& per_row, const at::Tensor& copies) {
  const kernels::RowRelation relation =
      kernels::MakeRowRelation(copies.contiguous(), per_row.size(0));
  return kernels::Collect(per_row, relation).to(per_row.scalar_type());
}

}  // namespace internal
}  // namespace moefit::experts
