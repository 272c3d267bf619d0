// Bucketed gradient all-reduce; see grad_sync.h.
#include "parallel/grad_sync.h"

#include <ATen/ATen.h>

namespace moefit::parallel {

void AllReduceSum(Communicator& comm, const std::vector<at::Tensor>& tensors,
                  const GradSyncOptions& options) {
  if (comm.size() == 1) return;
  size_t i = 0;
  while (i < tensors.size()) {
    if (!tensors[i].defined()) {
      ++i;
      continue;
    }
    // A bucket: consecutive defined tensors of one dtype and device.
    std::vector<at::Tensor> bucket;
    int64_t bytes = 0;
    const at::ScalarType dtype = tensors[i].scalar_type();
    const c10::Device device = tensors[i].device();
    while (i < tensors.size() && tensors[i].defined() && tensors[i].scalar_type() == dtype &&
           tensors[i].device() == device &&
           (bucket.empty() ||
            bytes + static_cast<int64_t>(tensors[i].nbytes()) <= options.bucket_bytes)) {
      bucket.push_back(tensors[i]);
      bytes += static_cast<int64_t>(tensors[i].nbytes());
      ++i;
    }
    std::vector<at::Tensor> flat_parts;
    for (const at::Tensor& t : bucket) flat_parts.push_back(t.reshape({-1}));
    at::Tensor flat = at::cat(flat_parts).to(comm.device()).contiguous();
    comm.AllReduce(flat, ReduceOp::kSum)->WaitOrThrow();
    flat = flat.to(device);
    int64_t offset = 0;
    for (const at::Tensor& t : bucket) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace moefit::parallel
