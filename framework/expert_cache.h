// Hot experts computed on a device of their own: one MoE layer's share of the
// hot-expert cache (the choice of experts is router/hot_expert_cache.h's).
//
// The rows a layer's experts receive arrive grouped by local expert. With a
// cache, the rows of the cached experts go to the cache's device and are
// computed there by a second backend (`eager`, ATen ops, which run on any
// device) from the device's copies of those experts' weights; the other
// experts' rows are computed on the host as always; the outputs are put
// back in the rows' order. Autograd carries every gradient home: the input
// rows', and the weights' and adapters' through the copies.
//
// Where the weights live:
//  * a frozen base (LoRA, eval): the device keeps its copies of the cached
//    experts' weights from one change of the set to the next (SetExperts
//    copies the newly cached ones); the adapters, trained and small, go over
//    with each step's rows;
//  * trained weights: the device computes with the cached experts' current
//    weights, copied over with each step's rows (their float32 masters and
//    AdamW states stay on the host, where the optimizer updates them).
//
// The device may be the CPU: a second CPU compute path, the twin on which
// the cache's results are tested against the run without it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

#include "experts/expert_backend.h"
#include "experts/expert_function.h"

namespace moefit::framework {

class LayerExpertCache {
 public:
  LayerExpertCache() = default;

  // The cached local experts (ascending, distinct, < the layer's local
  // expert count) on `device`. With `frozen` (the base weights are not
  // trained) the device keeps their weights: those of the newly cached
  // experts are copied there, those of the evicted dropped.
  void SetExperts(std::vector<int64_t> local_experts, const experts::ExpertWeights& host,
                  c10::Device device, bool frozen);
  const std::vector<int64_t>& experts() const { return experts_; }
  bool empty() const { return experts_.empty(); }

  // The layer's expert computation with the cached experts on the device:
  // what experts::ExpertFfn(host_backend, x, counts, host, ffn) computes,
  // where x is `rows` read through `row_index` (undefined: the rows
  // themselves) and counts has one segment per local expert. Adds the rows
  // the device computed to *device_rows.
  at::Tensor Compute(experts::ExpertBackend& host_backend, experts::ExpertBackend& device_backend,
                     const at::Tensor& rows, const at::Tensor& row_index,
                     const std::vector<int64_t>& counts, const experts::ExpertWeights& host,
                     const experts::ExpertFfnOptions& ffn, int64_t* device_rows) const;

 private:
  // The device's weights of the cached experts for this step.
  experts::ExpertWeights DeviceWeights(const experts::ExpertWeights& host,
                                       const experts::ExpertFfnOptions& ffn) const;

  std::vector<int64_t> experts_;
  c10::Device device_ = c10::kCPU;
  // A frozen base's weights of experts_, kept on the device.
  at::Tensor gate_up_, down_;
};

}  // namespace moefit::framework
