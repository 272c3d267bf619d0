// Bucketed gradient all-reduce; see grad_sync.h. Bucketing and flattening are
// LibTorch's own (torch::utils::take_tensors, as c10d's reducer uses).
#include "parallel/grad_sync.h"

#include <ATen/ATen.h>
#include <torch/csrc/utils/tensor_flatten.h>

#include "parallel/progress.h"

namespace moefit::parallel {

void AllReduceSum(Communicator& comm, const std::vector<at::Tensor>& tensors,
                  const GradSyncOptions& options) {
  if (comm.size() == 1) return;
  const ScopedPhase phase("gradient all-reduce");
  std::vector<at::Tensor> defined;
  for (const at::Tensor& t : tensors) {
    if (t.defined()) defined.push_back(t);
  }
  // Buckets of one dtype and device, at most bucket_bytes each.
  for (torch::utils::TensorGroup& bucket :
       torch::utils::take_tensors(defined, static_cast<size_t>(options.bucket_bytes))) {
    const c10::Device device = bucket.tensors.front().device();
    at::Tensor flat = torch::utils::flatten_dense_tensors(bucket.tensors).to(comm.device());
    comm.AllReduce(flat, ReduceOp::kSum)->WaitOrThrow();
    std::vector<at::Tensor> summed =
        torch::utils::unflatten_dense_tensors(flat.to(device), bucket.tensors);
    for (size_t i = 0; i < summed.size(); ++i) bucket.tensors[i].copy_(summed[i]);
  }
}

}  // namespace moefit::parallel
