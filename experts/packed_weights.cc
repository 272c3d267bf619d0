// The packed-weight cache of the expert layer; see packed_weights.h.
#include "experts/packed_weights.h"

#include <c10/core/TensorImpl.h>

#include <algorithm>

namespace moefit::experts {
namespace {

kernels::ElemType WeightType(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kernels::ElemType::kF32;
    case at::kBFloat16:
      return kernels::ElemType::kBF16;
    case at::kFloat8_e4m3fn:
      return kernels::ElemType::kF8E4M3;
    case at::kByte:
      return kernels::ElemType::kI4;
    default:
      TORCH_CHECK(false,
                  "expert weights are float32, bfloat16, float8_e4m3fn or int4 (uint8 bytes); got ",
                  t);
  }
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

kernels::Operand ExpertWeightOperand(const at::Tensor& w, const WeightQuantization& q, int64_t e,
                                     bool transposed) {
  TORCH_CHECK(w.dim() == 3 && e >= 0 && e < w.size(0), "expert weight ", w.sizes(),
              " has no expert ", e);
  kernels::Operand op;
  op.data = static_cast<const char*>(w.data_ptr()) + e * w.stride(0) * w.element_size();
  op.type = WeightType(w.scalar_type());
  if (op.type == kernels::ElemType::kI4) {
    // Strides in nibbles: each row's bytes contiguous.
    TORCH_CHECK(w.stride(2) == 1, "int4 expert weights need each row's bytes contiguous");
    TORCH_CHECK(q.scale.defined() && q.scale.scalar_type() == at::kBFloat16 && q.scale.dim() == 3 &&
                    q.group_size > 0 && q.group_size % 2 == 0 &&
                    w.size(2) == Int4RowBytes(q.columns) &&
                    q.scale.size(2) == (q.columns + q.group_size - 1) / q.group_size,
                "int4 expert weights [E, rows, ceil(cols / 8) * 4] need bfloat16 group scales "
                "[E, rows, ceil(cols / G)] and an even group size G; got ",
                w.sizes(), ", ", q.scale.defined() ? q.scale.sizes() : at::IntArrayRef{}, ", cols ",
                q.columns, " and G ", q.group_size);
    TORCH_CHECK(!q.zero_point.defined() || (q.zero_point.scalar_type() == at::kChar &&
                                            q.zero_point.sizes() == q.scale.sizes() &&
                                            q.zero_point.strides() == q.scale.strides()),
                "int4 zero points must be int8 and laid out as the scales");
    op.row_stride = transposed ? 1 : 2 * w.stride(1);
    op.col_stride = transposed ? 2 * w.stride(1) : 1;
    op.group_scales =
        reinterpret_cast<const uint16_t*>(q.scale.const_data_ptr()) + e * q.scale.stride(0);
    if (q.zero_point.defined()) {
      op.zero_points = q.zero_point.const_data_ptr<int8_t>() + e * q.zero_point.stride(0);
    }
    op.group_rows = transposed ? q.group_size : 1;
    op.group_cols = transposed ? 1 : q.group_size;
    op.scale_row_stride = transposed ? q.scale.stride(2) : q.scale.stride(1);
    op.scale_col_stride = transposed ? q.scale.stride(1) : q.scale.stride(2);
    return op;
  }
  op.row_stride = transposed ? w.stride(2) : w.stride(1);
  op.col_stride = transposed ? w.stride(1) : w.stride(2);
  if (op.type == kernels::ElemType::kF8E4M3) {
    TORCH_CHECK(q.scale.defined() && q.scale.scalar_type() == at::kFloat && q.scale.dim() == 3,
                "FP8 expert weights need float32 block scales [E, rows/128, cols/128]");
    op.scales = q.scale.const_data_ptr<float>() + e * q.scale.stride(0);
    op.scale_row_stride = transposed ? q.scale.stride(2) : q.scale.stride(1);
    op.scale_col_stride = transposed ? q.scale.stride(1) : q.scale.stride(2);
  }
  return op;
}

const kernels::PackedB& PackedWeightCache::Packs::Get(int64_t e) const {
  Slot& slot = slots_[e];
  std::call_once(slot.once, [&] {
    kernels::Operand op = first_;
    op.data = static_cast<const char*>(first_.data) + e * expert_stride_bytes_;
    if (op.scales != nullptr) op.scales = first_.scales + e * scale_expert_stride_;
    if (op.group_scales != nullptr)
      op.group_scales = first_.group_scales + e * scale_expert_stride_;
    if (op.zero_points != nullptr) op.zero_points = first_.zero_points + e * zero_expert_stride_;
    slot.pack = kernels::PackedB(isa_, a_type_, k_size_, n_, op);
  });
  return slot.pack;
}

bool PackedWeightCache::Matches(const Entry& e, const at::Tensor& w, bool transposed,
                                kernels::Isa isa, kernels::ElemType a_type) const {
  return e.weight.storage_id == StorageId(w) && e.weight.offset == w.storage_offset() &&
         e.dtype == w.scalar_type() && e.transposed == transposed && e.isa == isa &&
         e.a_type == a_type && w.sizes() == at::IntArrayRef(e.sizes) &&
         w.strides() == at::IntArrayRef(e.strides);
}

namespace {

// Whether `t` is the tensor `r` recorded, unchanged since: its storage
// still alive (so its address was not reused by another) and not written.
template <typename TrackedT>
bool Unchanged(const TrackedT& r, const at::Tensor& t) {
  if (r.storage_id != StorageId(t)) return false;
  if (!t.defined()) return true;
  return !Expired(r.storage) && r.offset == t.storage_offset() && r.version == Version(t);
}

template <typename TrackedT>
TrackedT Track(const at::Tensor& t) {
  TrackedT r;
  r.storage = WeakStorage(t);
  r.storage_id = StorageId(t);
  r.offset = t.defined() ? t.storage_offset() : 0;
  r.version = Version(t);
  return r;
}

}  // namespace

bool PackedWeightCache::Current(const Entry& e, const at::Tensor& w, const WeightQuantization& q) {
  // None of the tensors the packs were made from written since.
  return Unchanged(e.weight, w) && Unchanged(e.scale, q.scale) &&
         Unchanged(e.zero_point, q.zero_point) && e.group_size == q.group_size &&
         e.columns == q.columns;
}

PackedWeightCache::Entry PackedWeightCache::Record(const at::Tensor& w, const WeightQuantization& q,
                                                   bool transposed, kernels::Isa isa,
                                                   kernels::ElemType a_type) {
  Entry entry;
  entry.weight = Track<Tracked>(w);
  entry.scale = Track<Tracked>(q.scale);
  entry.zero_point = Track<Tracked>(q.zero_point);
  entry.sizes = w.sizes().vec();
  entry.strides = w.strides().vec();
  entry.dtype = w.scalar_type();
  entry.group_size = q.group_size;
  entry.columns = q.columns;
  entry.transposed = transposed;
  entry.isa = isa;
  entry.a_type = a_type;
  return entry;
}

std::shared_ptr<const PackedWeightCache::Packs> PackedWeightCache::Lookup(
    const at::Tensor& w, const WeightQuantization& q, bool transposed, kernels::Isa isa,
    kernels::ElemType a_type) {
  if (max_bytes_ <= 0 || !w.defined() || w.dim() != 3 || w.scalar_type() == at::kDouble ||
      !Trackable(w) || !Trackable(q.scale) || !Trackable(q.zero_point)) {
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
    if (Current(*it, w, q)) {
      if (it->packs != nullptr) return it->packs;
      seen = true;
    } else if (it->packs != nullptr) {
      ++rebuilds_;
    }
    bytes_ -= it->bytes;
    entries_.erase(it);
  }
  const int64_t experts = w.size(0);
  const int64_t cols = w.scalar_type() == at::kByte ? q.columns : w.size(2);
  const int64_t k_size = transposed ? cols : w.size(1);
  const int64_t n = transposed ? w.size(1) : cols;
  if (!seen) {
    entries_.push_back(Record(w, q, transposed, isa, a_type));
    return nullptr;
  }
  const int64_t bytes =
      experts * kernels::PackedB::Bytes(isa, a_type, k_size, n, WeightType(w.scalar_type()));
  if (bytes_ + bytes > max_bytes_) {
    // Room from entries whose weights changed or were freed; valid ones
    // stay (dropping them would only move the packing elsewhere).
    for (auto e = entries_.begin(); e != entries_.end();) {
      if (Expired(e->weight.storage)) {
        bytes_ -= e->bytes;
        e = entries_.erase(e);
      } else {
        ++e;
      }
    }
    if (bytes_ + bytes > max_bytes_) return nullptr;
  }
  auto packs = std::make_shared<Packs>();
  packs->first_ = ExpertWeightOperand(w, q, 0, transposed);
  packs->expert_stride_bytes_ = w.stride(0) * static_cast<int64_t>(w.element_size());
  if (q.scale.defined()) packs->scale_expert_stride_ = q.scale.stride(0);
  if (q.zero_point.defined()) packs->zero_expert_stride_ = q.zero_point.stride(0);
  packs->k_size_ = k_size;
  packs->n_ = n;
  packs->isa_ = isa;
  packs->a_type_ = a_type;
  packs->slots_ = std::make_unique<Packs::Slot[]>(static_cast<size_t>(experts));
  Entry entry = Record(w, q, transposed, isa, a_type);
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
