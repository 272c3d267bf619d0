// One MoE layer's hot experts on a device of their own; see expert_cache.h.
#include "framework/expert_cache.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>

namespace moefit::framework {
namespace {

at::Tensor Index(const std::vector<int64_t>& v) { return at::tensor(v, at::kLong); }

// Rows `idx` of `t` (dim 0) on `device`, in autograd's graph.
at::Tensor Rows(const at::Tensor& t, const at::Tensor& idx, c10::Device device) {
  return t.index_select(0, idx).to(device);
}

}  // namespace

void LayerExpertCache::SetExperts(std::vector<int64_t> local_experts,
                                  const experts::ExpertWeights& host, c10::Device device,
                                  bool frozen) {
  TORCH_CHECK(
      std::is_sorted(local_experts.begin(), local_experts.end()) &&
          std::adjacent_find(local_experts.begin(), local_experts.end()) == local_experts.end(),
      "cached experts must be ascending and distinct");
  TORCH_CHECK(local_experts.empty() ||
                  (local_experts.front() >= 0 && local_experts.back() < host.gate_up_proj.size(0)),
              "cached expert out of range");
  TORCH_CHECK(host.gate_up_proj.scalar_type() != at::kFloat8_e4m3fn && !host.int4(),
              "the hot-expert cache holds float32 or bfloat16 experts");
  at::Tensor gate_up, down;
  if (frozen && !local_experts.empty()) {
    // Experts already on the device stay there; only the newly cached cross.
    std::map<int64_t, int64_t> slot;
    for (size_t i = 0; i < experts_.size(); ++i) slot[experts_[i]] = static_cast<int64_t>(i);
    std::vector<at::Tensor> g, d;
    at::NoGradGuard no_grad;
    for (int64_t e : local_experts) {
      auto it = slot.find(e);
      const bool kept = it != slot.end() && gate_up_.defined() && device_ == device;
      g.push_back(kept ? gate_up_[it->second] : host.gate_up_proj[e].to(device));
      d.push_back(kept ? down_[it->second] : host.down_proj[e].to(device));
    }
    gate_up = at::stack(g);
    down = at::stack(d);
  }
  experts_ = std::move(local_experts);
  device_ = device;
  gate_up_ = gate_up;
  down_ = down;
}

experts::ExpertWeights LayerExpertCache::DeviceWeights(const experts::ExpertWeights& host,
                                                       const experts::ExpertFfnOptions& ffn) const {
  const at::Tensor idx = Index(experts_);
  experts::ExpertWeights w;
  if (gate_up_.defined()) {
    w.gate_up_proj = gate_up_;
    w.down_proj = down_;
  } else {
    // Trained: this step's weights (the compute copies, with masters; the
    // gradients go to the masters through ffn's master slices, see Compute).
    w.gate_up_proj = Rows(host.gate_up_proj, idx, device_);
    w.down_proj = Rows(host.down_proj, idx, device_);
  }
  const experts::ExpertLora& l = host.lora;
  w.lora.scaling = l.scaling;
  if (l.has_gate_up()) {
    w.lora.gate_up_a = Rows(l.gate_up_a, idx, device_);
    w.lora.gate_up_b = Rows(l.gate_up_b, idx, device_);
  }
  if (l.has_down()) {
    w.lora.down_a = Rows(l.down_a, idx, device_);
    w.lora.down_b = Rows(l.down_b, idx, device_);
  }
  return w;
}

at::Tensor LayerExpertCache::Compute(experts::ExpertBackend& host_backend,
                                     experts::ExpertBackend& device_backend, const at::Tensor& rows,
                                     const at::Tensor& row_index,
                                     const std::vector<int64_t>& counts,
                                     const experts::ExpertWeights& host,
                                     const experts::ExpertFfnOptions& ffn,
                                     int64_t* device_rows) const {
  const int64_t num_local = static_cast<int64_t>(counts.size());
  TORCH_CHECK(num_local == host.gate_up_proj.size(0), counts.size(), " segments for ",
              host.gate_up_proj.size(0), " local experts");
  std::vector<int64_t> slot(static_cast<size_t>(num_local), -1);
  for (size_t i = 0; i < experts_.size(); ++i) slot[experts_[i]] = static_cast<int64_t>(i);
  // Rows of the host's experts and of the device's, each in segment order.
  std::vector<int64_t> host_rows, dev_rows;
  std::vector<int64_t> host_counts = counts, dev_counts(experts_.size(), 0);
  int64_t at = 0;
  for (int64_t e = 0; e < num_local; ++e) {
    std::vector<int64_t>& to = slot[e] >= 0 ? dev_rows : host_rows;
    for (int64_t r = 0; r < counts[e]; ++r) to.push_back(at + r);
    if (slot[e] >= 0) {
      dev_counts[slot[e]] = counts[e];
      host_counts[e] = 0;
    }
    at += counts[e];
  }
  // The rows themselves (read once per expert they visit).
  const at::Tensor x = row_index.defined() ? rows.index_select(0, row_index) : rows;
  at::Tensor y = at::zeros({at, x.size(1)}, x.options().requires_grad(false));
  experts::ExpertFfnOptions host_ffn = ffn;
  host_ffn.row_index = at::Tensor();
  host_ffn.row_copies = at::Tensor();
  const at::Tensor host_idx = Index(host_rows);
  y = y.index_copy(
      0, host_idx,
      experts::ExpertFfn(host_backend, x.index_select(0, host_idx), host_counts, host, host_ffn));
  if (!dev_rows.empty()) {
    const at::Tensor idx = Index(experts_), dev_idx = Index(dev_rows);
    experts::ExpertFfnOptions dev_ffn;
    dev_ffn.recompute = ffn.recompute;
    if (ffn.gate_up_master.defined() && !gate_up_.defined()) {
      dev_ffn.gate_up_master = Rows(ffn.gate_up_master, idx, device_);
      dev_ffn.down_master = Rows(ffn.down_master, idx, device_);
    }
    const at::Tensor y_dev = experts::ExpertFfn(device_backend, Rows(x, dev_idx, device_),
                                                dev_counts, DeviceWeights(host, ffn), dev_ffn);
    y = y.index_copy(0, dev_idx, y_dev.to(x.device()));
    *device_rows += static_cast<int64_t>(dev_rows.size());
  }
  return y;
}

}  // namespace moefit::framework
