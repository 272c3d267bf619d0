// Bucketed gradient all-reduce, after backward and during it; see
// grad_sync.h. The after-backward twin buckets with LibTorch's own
// torch::utils::take_tensors (as c10d's reducer does); the overlapped one
// hooks each parameter's gradient accumulator (AccumulateGrad's post hooks,
// the mechanism c10d's reducer uses) and keeps one persistent flat buffer per
// bucket, so a step allocates nothing.
#include "parallel/grad_sync.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/tensor_flatten.h>

#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
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

namespace {

// AccumulateGrad nodes are held through c10::intrusive_ptr or std::shared_ptr
// depending on the LibTorch version; either keeps the node alive.
using AccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

}  // namespace

struct OverlappedGradSync::Impl {
  // Where a parameter's gradient sits in its bucket.
  struct Slot {
    int64_t bucket_idx = 0;
    int64_t offset = 0;  // elements into the bucket's buffer
    int64_t numel = 0;
    bool filled = false;  // this armed backward copied its gradient in
  };
  struct Bucket {
    std::vector<int64_t> param_idx;
    // [sum of numel + one presence element per parameter] on the
    // communicator's device: the gradients, then 1 where this rank had a
    // gradient and 0 where not; after the sum, how many ranks had one.
    at::Tensor flat;
    int64_t presence_offset = 0;
    // The presence elements on the host, float32: written before the
    // all-reduce, read back after it.
    at::Tensor presence;
    int64_t num_filled = 0;
    std::shared_ptr<Work> work;  // set once posted
  };

  std::shared_ptr<Communicator> comm;
  std::vector<at::Tensor> params;
  std::vector<Slot> slots;
  std::vector<Bucket> buckets;
  std::vector<AccumulatorPtr> accumulators;
  std::vector<uintptr_t> hook_keys;
  std::optional<c10::Stream> side_stream;  // CUDA communicators only
  const std::thread::id owner = std::this_thread::get_id();

  std::mutex mu;  // hooks of CPU and CUDA parameters may run on two threads
  bool armed = false;
  int64_t next_bucket = 0;  // the first bucket not posted yet
  GradSyncStats stats;

  bool MayPostHere() const {
    return comm->PostsFromAnyThread() || std::this_thread::get_id() == owner;
  }

  void CopyIn(int64_t param_idx) {
    const Slot& slot = slots[param_idx];
    at::Tensor dst = buckets[slot.bucket_idx].flat.narrow(0, slot.offset, slot.numel);
    const at::Tensor& grad = params[param_idx].grad();
    if (grad.defined()) {
      dst.copy_(grad.reshape({-1}));
    } else {
      dst.zero_();
    }
  }

  void Post(int64_t bucket_idx) {
    Bucket& b = buckets[bucket_idx];
    float* had = b.presence.data_ptr<float>();
    for (size_t k = 0; k < b.param_idx.size(); ++k) {
      had[k] = params[b.param_idx[k]].grad().defined() ? 1.0f : 0.0f;
    }
    b.flat.narrow(0, b.presence_offset, b.presence.numel()).copy_(b.presence);
    std::optional<c10::StreamGuard> on_side;
    if (side_stream.has_value()) {
      // The gradients were written on the current stream: the side stream
      // waits for them, then runs the all-reduce beside backward's kernels.
      const c10::impl::VirtualGuardImpl impl(side_stream->device_type());
      c10::Event written(side_stream->device_type());
      written.record(impl.getStream(side_stream->device()));
      written.block(*side_stream);
      on_side.emplace(*side_stream);
    }
    b.work = comm->AllReduce(b.flat, ReduceOp::kSum);
  }

  // Posts, in bucket order, every bucket whose gradients are all in.
  void PostFilled() {
    while (next_bucket < static_cast<int64_t>(buckets.size()) &&
           buckets[next_bucket].num_filled ==
               static_cast<int64_t>(buckets[next_bucket].param_idx.size())) {
      Post(next_bucket++);
      ++stats.num_posted_during_backward;
    }
  }

  // The hook of parameter `param_idx`: its gradient is complete for this
  // backward (or for this part of it).
  void OnGradient(int64_t param_idx) {
    const std::lock_guard<std::mutex> lock(mu);
    if (!armed) return;
    Slot& slot = slots[param_idx];
    Bucket& b = buckets[slot.bucket_idx];
    TORCH_CHECK(slot.bucket_idx >= next_bucket, "the gradient of parameter ", param_idx, " (shape ",
                params[param_idx].sizes(),
                ") was accumulated again after its bucket was all-reduced; gradients may be "
                "accumulated only once per armed backward");
    CopyIn(param_idx);
    if (!slot.filled) {
      slot.filled = true;
      ++b.num_filled;
    }
    if (!MayPostHere()) return;
    PostFilled();
    // Non-blocking MPI collectives move on only inside MPI calls.
    for (int64_t i = 0; i < next_bucket; ++i) (void)buckets[i].work->IsCompleted();
  }
};

absl::StatusOr<std::unique_ptr<OverlappedGradSync>> OverlappedGradSync::Create(
    Communicator& comm, std::vector<at::Tensor> params, const GradSyncOptions& options) {
  auto impl = std::make_shared<Impl>();
  absl::StatusOr<std::shared_ptr<Communicator>> own =
      comm.Split(/*color=*/0, /*key=*/comm.rank(), absl::StrCat(comm.name(), "-grad"));
  if (!own.ok()) return own.status();
  impl->comm = *std::move(own);
  impl->params = std::move(params);
  const c10::Device device = impl->comm->device();
  if (device.is_cuda()) {
    impl->side_stream = c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device);
  }

  // Buckets in reverse parameter order, one open bucket per dtype.
  const int64_t num_params = static_cast<int64_t>(impl->params.size());
  impl->slots.resize(num_params);
  std::map<c10::ScalarType, int64_t> open;  // dtype -> bucket index
  std::vector<int64_t> bucket_numel;
  for (int64_t i = num_params - 1; i >= 0; --i) {
    const at::Tensor& p = impl->params[i];
    TORCH_CHECK(p.defined() && p.requires_grad() && p.is_leaf(), "OverlappedGradSync: parameter ",
                i, " is not a leaf tensor that requires grad");
    TORCH_CHECK(at::isFloatingType(p.scalar_type()), "OverlappedGradSync: parameter ", i, " is ",
                p.scalar_type(), ", not a floating type");
    auto it = open.find(p.scalar_type());
    if (it == open.end() ||
        (bucket_numel[it->second] + p.numel()) * p.element_size() > options.bucket_bytes) {
      impl->buckets.emplace_back();
      bucket_numel.push_back(0);
      it = open.insert_or_assign(p.scalar_type(), static_cast<int64_t>(impl->buckets.size()) - 1)
               .first;
    }
    Impl::Slot& slot = impl->slots[i];
    slot.bucket_idx = it->second;
    slot.offset = bucket_numel[it->second];
    slot.numel = p.numel();
    bucket_numel[it->second] += p.numel();
    impl->buckets[it->second].param_idx.push_back(i);
  }
  for (size_t b = 0; b < impl->buckets.size(); ++b) {
    Impl::Bucket& bucket = impl->buckets[b];
    const at::Tensor& first = impl->params[bucket.param_idx.front()];
    bucket.presence_offset = bucket_numel[b];
    const int64_t n = static_cast<int64_t>(bucket.param_idx.size());
    bucket.flat = at::zeros({bucket_numel[b] + n},
                            at::TensorOptions().dtype(first.scalar_type()).device(device));
    bucket.presence = at::zeros({n}, at::kFloat);
  }
  impl->stats.num_buckets = static_cast<int64_t>(impl->buckets.size());

  if (impl->comm->size() > 1) {
    const std::weak_ptr<Impl> weak = impl;
    for (int64_t i = 0; i < num_params; ++i) {
      AccumulatorPtr acc = torch::autograd::impl::grad_accumulator(impl->params[i]);
      TORCH_CHECK(acc, "OverlappedGradSync: parameter ", i, " has no gradient accumulator");
      impl->hook_keys.push_back(
          acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
              [weak, i](const torch::autograd::variable_list& outputs,
                        const torch::autograd::variable_list&) {
                if (const std::shared_ptr<Impl> self = weak.lock()) self->OnGradient(i);
                return outputs;
              })));
      impl->accumulators.push_back(std::move(acc));
    }
  }
  return std::unique_ptr<OverlappedGradSync>(new OverlappedGradSync(std::move(impl)));
}

OverlappedGradSync::OverlappedGradSync(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

OverlappedGradSync::~OverlappedGradSync() {
  for (size_t i = 0; i < impl_->accumulators.size(); ++i) {
    impl_->accumulators[i]->del_post_hook(impl_->hook_keys[i]);
  }
}

void OverlappedGradSync::Arm() {
  Impl& s = *impl_;
  const std::lock_guard<std::mutex> lock(s.mu);
  TORCH_CHECK(!s.armed, "OverlappedGradSync::Arm: already armed (Finish was not called)");
  if (s.comm->size() == 1) return;
  s.armed = true;
  s.next_bucket = 0;
  for (Impl::Slot& slot : s.slots) slot.filled = false;
  for (Impl::Bucket& b : s.buckets) {
    b.num_filled = 0;
    b.work.reset();
  }
  s.stats.num_posted_during_backward = 0;
  s.stats.finish_seconds = 0;
}

void OverlappedGradSync::Finish() {
  Impl& s = *impl_;
  if (s.comm->size() == 1) return;
  const std::lock_guard<std::mutex> lock(s.mu);
  TORCH_CHECK(s.armed, "OverlappedGradSync::Finish without Arm");
  const auto start = std::chrono::steady_clock::now();
  const ScopedPhase phase("gradient all-reduce");
  // Gradients the armed backward did not touch: accumulated by earlier
  // micro-batches only, or none at all (zeros, presence 0).
  for (int64_t b = s.next_bucket; b < static_cast<int64_t>(s.buckets.size()); ++b) {
    for (int64_t p : s.buckets[b].param_idx) {
      if (!s.slots[p].filled) s.CopyIn(p);
    }
  }
  while (s.next_bucket < static_cast<int64_t>(s.buckets.size())) s.Post(s.next_bucket++);
  s.armed = false;
  for (Impl::Bucket& b : s.buckets) b.work->WaitOrThrow();
  for (Impl::Bucket& b : s.buckets) {
    const int64_t n = static_cast<int64_t>(b.param_idx.size());
    b.presence.copy_(b.flat.narrow(0, b.presence_offset, n));
    const float* had = b.presence.data_ptr<float>();
    for (int64_t k = 0; k < n; ++k) {
      if (had[k] == 0) continue;  // no rank had a gradient: stays undefined
      at::Tensor& param = s.params[b.param_idx[k]];
      const Impl::Slot& slot = s.slots[b.param_idx[k]];
      const at::Tensor sum = b.flat.narrow(0, slot.offset, slot.numel).view(param.sizes());
      if (param.grad().defined()) {
        param.mutable_grad().copy_(sum);
      } else {
        param.mutable_grad() = sum.to(param.device(), /*non_blocking=*/false, /*copy=*/true);
      }
    }
  }
  s.stats.finish_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

const GradSyncStats& OverlappedGradSync::last_stats() const { return impl_->stats; }

std::vector<std::vector<int64_t>> OverlappedGradSync::bucket_params() const {
  std::vector<std::vector<int64_t>> out;
  for (const Impl::Bucket& b : impl_->buckets) out.push_back(b.param_idx);
  return out;
}

}  // namespace moefit::parallel
