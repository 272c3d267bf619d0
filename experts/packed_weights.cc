// The packed-weight cache of the expert layer; see packed_weights.h.
#include "experts/packed_weights.h"

#include <c10/core/TensorImpl.h>

#include <algorithm>

namespace moefit::experts {
namespace {

kernels::ElemType WeightType(at::ScalarType t) {
  return t == at::kBFloat16        ? kernels::ElemType::kBF16
         : t == at::kFloat8_e4m3fn ? kernels::ElemType::kF8E4M3
                                   : kernels::ElemType::kF32;
}

uint32_t Version(const at::Tensor& t) {
  return t.defined() ? t.unsafeGetTensorImpl()->version_counter().current_version() : 0;
}

const c10::StorageImpl* StorageId(const at::Tensor& t) {
  return t.defined() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> WeakStorage(const at::Tensor& t) {
  if (!t.defined()) return std::nullopt;
  return t.storage().getWeakStorageImpl();
}

// A storage recorded weakly is gone (and its address may be another's now).
bool Expired(const std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>>& s) {
  return !s.has_value() || s->expired();
}

bool Trackable(const at::Tensor& t) {
  return !t.defined() || (t.device().is_cpu() && !t.is_inference() && t.has_storage());
}

}  // namespace

const kernels::PackedB& PackedWeightCache::Packs::Get(int64_t e) const {
  Slot& slot = slots_[e];
  std::call_once(slot.once, [&] {
    kernels::Operand op = first_;
    op.data = static_cast<const char*>(first_.data) + e * expert_stride_bytes_;
    if (op.scales != nullptr) op.scales = first_.scales + e * scale_expert_stride_;
    slot.pack = kernels::PackedB(isa_, a_type_, k_size_, n_, op);
  });
  return slot.pack;
}

bool PackedWeightCache::Matches(const Entry& e, const at::Tensor& w, bool transposed,
                                kernels::Isa isa, kernels::ElemType a_type) const {
  return e.storage_id == StorageId(w) && e.offset == w.storage_offset() &&
         e.dtype == w.scalar_type() && e.transposed == transposed && e.isa == isa &&
         e.a_type == a_type && w.sizes() == at::IntArrayRef(e.sizes) &&
         w.strides() == at::IntArrayRef(e.strides);
}

bool PackedWeightCache::Current(const Entry& e, const at::Tensor& w, const at::Tensor& scale) {
  // The storage still alive (so its address was not reused by another) and
  // neither tensor written since the packs were made.
  return !Expired(e.storage) && e.version == Version(w) && e.scale_storage_id == StorageId(scale) &&
         (scale.defined() ? !Expired(e.scale_storage) && e.scale_offset == scale.storage_offset()
                          : true) &&
         e.scale_version == Version(scale);
}

PackedWeightCache::Entry PackedWeightCache::Record(const at::Tensor& w, const at::Tensor& scale,
                                                   bool transposed, kernels::Isa isa,
                                                   kernels::ElemType a_type) {
  Entry entry;
  entry.storage = WeakStorage(w);
  entry.scale_storage = WeakStorage(scale);
  entry.storage_id = StorageId(w);
  entry.scale_storage_id = StorageId(scale);
  entry.offset = w.storage_offset();
  entry.scale_offset = scale.defined() ? scale.storage_offset() : 0;
  entry.sizes = w.sizes().vec();
  entry.strides = w.strides().vec();
  entry.dtype = w.scalar_type();
  entry.transposed = transposed;
  entry.isa = isa;
  entry.a_type = a_type;
  entry.version = Version(w);
  entry.scale_version = Version(scale);
  return entry;
}

std::shared_ptr<const PackedWeightCache::Packs> PackedWeightCache::Lookup(
    const at::Tensor& w, const at::Tensor& scale, bool transposed, kernels::Isa isa,
    kernels::ElemType a_type) {
  if (max_bytes_ <= 0 || !w.defined() || w.dim() != 3 || w.scalar_type() == at::kDouble ||
      !Trackable(w) || !Trackable(scale)) {
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = std::find_if(entries_.begin(), entries_.end(),
                         [&](const Entry& e) { return Matches(e, w, transposed, isa, a_type); });
  // A weight is packed ahead on the second lookup of the same contents: a
  // pack used once costs a round trip through memory that packing block by
  // block inside the GEMM (in cache) does not, so a weight that changes
  // between every two uses is left to the per-call path.
  bool seen = false;
  if (it != entries_.end()) {
    if (Current(*it, w, scale)) {
      if (it->packs != nullptr) return it->packs;
      seen = true;
    } else if (it->packs != nullptr) {
      ++rebuilds_;
    }
    bytes_ -= it->bytes;
    entries_.erase(it);
  }
  const int64_t experts = w.size(0);
  const int64_t k_size = transposed ? w.size(2) : w.size(1);
  const int64_t n = transposed ? w.size(1) : w.size(2);
  if (!seen) {
    entries_.push_back(Record(w, scale, transposed, isa, a_type));
    return nullptr;
  }
  const int64_t bytes =
      experts * kernels::PackedB::Bytes(isa, a_type, k_size, n, WeightType(w.scalar_type()));
  if (bytes_ + bytes > max_bytes_) {
    // Room from entries whose weights changed or were freed; valid ones
    // stay (dropping them would only move the packing elsewhere).
    for (auto e = entries_.begin(); e != entries_.end();) {
      if (Expired(e->storage)) {
        bytes_ -= e->bytes;
        e = entries_.erase(e);
      } else {
        ++e;
      }
    }
    if (bytes_ + bytes > max_bytes_) return nullptr;
  }
  auto packs = std::make_shared<Packs>();
  kernels::Operand& op = packs->first_;
  op.data = w.data_ptr();
  op.type = WeightType(w.scalar_type());
  op.row_stride = transposed ? w.stride(2) : w.stride(1);
  op.col_stride = transposed ? w.stride(1) : w.stride(2);
  packs->expert_stride_bytes_ = w.stride(0) * static_cast<int64_t>(w.element_size());
  if (op.type == kernels::ElemType::kF8E4M3) {
    TORCH_CHECK(scale.defined() && scale.scalar_type() == at::kFloat && scale.dim() == 3,
                "FP8 expert weights need float32 block scales [E, rows/128, cols/128]");
    op.scales = scale.data_ptr<float>();
    op.scale_row_stride = transposed ? scale.stride(2) : scale.stride(1);
    op.scale_col_stride = transposed ? scale.stride(1) : scale.stride(2);
    packs->scale_expert_stride_ = scale.stride(0);
  }
  packs->k_size_ = k_size;
  packs->n_ = n;
  packs->isa_ = isa;
  packs->a_type_ = a_type;
  packs->slots_ = std::make_unique<Packs::Slot[]>(static_cast<size_t>(experts));
  Entry entry = Record(w, scale, transposed, isa, a_type);
  entry.bytes = bytes;
  entry.packs = packs;
  entries_.push_back(std::move(entry));
  bytes_ += bytes;
  return packs;
}

int64_t PackedWeightCache::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

int64_t PackedWeightCache::rebuilds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rebuilds_;
}

}  // namespace moefit::experts
