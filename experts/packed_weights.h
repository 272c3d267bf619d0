// Expert weights packed ahead of the GEMMs that multiply by them, kept from
// one call to the next while the weights stay the same.
//
// The blocked GEMM (kernels/gemm.h) converts and packs B, here an expert's
// weight, into the microkernel's panels on every call: once for the forward
// pass, once for dX, once more when the forward is recomputed, and once per
// row tile of a hot expert. A PackedWeightCache packs each (weight,
// orientation, expert) once and hands the pack to every later call, until the
// weight changes: a trainable weight is packed again after each optimizer
// step, a frozen one only after it is loaded or merged.
//
// Only what is used twice: a weight is packed on the second lookup of the
// same contents (a frozen weight from its second step on; a trained one when
// the step uses it twice in one orientation, as recomputation does), since a
// pack used once costs more than the GEMM's own packing block by block in
// cache.
//
// Never stale: an entry records the weight's storage (weakly) and ATen's
// version counter of the weight (and of its FP8 scales), which every in-place
// ATen op bumps (copy_, add_, the optimizer's twin ops, MergeAdapters'
// folds). Code that writes a weight's memory without ATen must bump it itself
// (c10::TensorImpl::bump_version(); FusedAdamW::Step does). A lookup whose
// recorded version, storage or shape differs drops the entry and packs anew;
// a weight freed and another allocated at the same address does not match.
//
// Memory: a pack is the weight converted to the kernels' panel format, 4
// bytes per element in float32 mode (float32 weights, and bfloat16 or FP8
// weights on AVX2, AVX-512F or portable kernels: 2x a bfloat16 weight, 4x an
// FP8 one, 8x an int4 one) and 2 bytes in bfloat16-pairs mode (amx_bf16, and avx512_bf16
// where it multiplies pairs: kernels::MultipliesBf16Pairs), where an FP8
// weight's pack keeps 1 byte per element (kernels::PackedB), per orientation
// used (forward and dX: two packs per weight). The cache keeps at most
// `max_bytes` of packs; a weight whose packs do not fit is packed per call
// as before (same bits), so memory stays bounded and speed degrades
// gracefully. Stale entries are dropped first when room is needed.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "experts/expert_backend.h"
#include "experts/kernels/gemm.h"

namespace moefit::experts {

// What a quantized weight is multiplied with beside its own elements
// (ExpertWeights): FP8's block scales, or int4's group scales, zero points
// (undefined for a symmetric scheme) and group size. Empty for float32 and
// bfloat16 weights.
struct WeightQuantization {
  at::Tensor scale, zero_point;
  int64_t group_size = 0;
  // int4: the weight's columns (each row's bytes hold Int4RowBytes(columns)).
  int64_t columns = 0;
};

// The operand of expert e's weight w[e] (w: [E, rows, cols], or int4 bytes
// [E, rows, Int4RowBytes(cols)]) read as W, or as Wᵀ, with its quantization.
kernels::Operand ExpertWeightOperand(const at::Tensor& w, const WeightQuantization& q, int64_t e,
                                     bool transposed);

class PackedWeightCache {
 public:
  // The packs of one weight in one orientation, one slot per expert, filled
  // as experts need them. Shared: callers keep it while their GEMMs run.
  class Packs {
   public:
    // Expert e's pack, made on first use (thread-safe; experts in parallel).
    const kernels::PackedB& Get(int64_t e) const;

   private:
    friend class PackedWeightCache;
    struct Slot {
      std::once_flag once;
      kernels::PackedB pack;
    };
    // Expert e's operand is `first` advanced by e * expert_stride_bytes bytes
    // (and its scales and zero points by e * their expert strides): the
    // weight is not held, only read while a caller that holds it calls Get.
    kernels::Operand first_;
    int64_t expert_stride_bytes_ = 0, scale_expert_stride_ = 0, zero_expert_stride_ = 0;
    int64_t k_size_ = 0, n_ = 0;
    kernels::Isa isa_ = kernels::Isa::kPortable;
    kernels::ElemType a_type_ = kernels::ElemType::kF32;
    std::unique_ptr<Slot[]> slots_;
  };

  explicit PackedWeightCache(int64_t max_bytes) : max_bytes_(max_bytes) {}

  // The packs of w ([E, rows, cols], with its quantization q where it is FP8
  // or int4) read as w[e] or, transposed, w[e]ᵀ, for `isa`'s kernels and an
  // A of type a_type; null when they do not fit the budget or w cannot be
  // tracked (not on the CPU, float64, an inference tensor), and on the first
  // lookup of w's current contents (see above). The caller keeps
  // w alive and unchanged while it uses the returned Packs (the expert layer
  // looks up at the start of each forward or backward call).
  std::shared_ptr<const Packs> Lookup(const at::Tensor& w, const WeightQuantization& q,
                                      bool transposed, kernels::Isa isa, kernels::ElemType a_type);

  // Bytes the cache holds or has promised to entries (their full size, as if
  // every expert were packed).
  int64_t bytes() const;
  // Entries dropped because their weight changed, since construction.
  int64_t rebuilds() const;

 private:
  // Which memory a tensor is and how often it was written, recorded weakly:
  // an entry does not keep a freed tensor's memory alive.
  struct Tracked {
    std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;
    const c10::StorageImpl* storage_id = nullptr;
    int64_t offset = 0;
    uint32_t version = 0;
  };
  struct Entry {
    Tracked weight, scale, zero_point;
    std::vector<int64_t> sizes, strides;
    at::ScalarType dtype = at::kFloat;
    int64_t group_size = 0, columns = 0;
    bool transposed = false;
    kernels::Isa isa = kernels::Isa::kPortable;
    kernels::ElemType a_type = kernels::ElemType::kF32;
    int64_t bytes = 0;
    std::shared_ptr<Packs> packs;  // null: seen once, not packed yet
  };

  bool Matches(const Entry& e, const at::Tensor& w, bool transposed, kernels::Isa isa,
               kernels::ElemType a_type) const;
  static bool Current(const Entry& e, const at::Tensor& w, const WeightQuantization& q);
  // An entry for w's current contents, without packs.
  static Entry Record(const at::Tensor& w, const WeightQuantization& q, bool transposed,
                      kernels::Isa isa, kernels::ElemType a_type);

  mutable std::mutex mu_;
  int64_t max_bytes_;
  int64_t bytes_ = 0;
  int64_t rebuilds_ = 0;
  std::vector<Entry> entries_;
};

}  // namespace moefit::experts
