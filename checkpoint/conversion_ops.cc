// The reference implementation of the converter operations (see conversion_ops.h).
//
// Each op is a few torch calls; all torch errors are caught here and turned
// into absl::Status naming the op, so the loader can prefix the target's name.
#include "checkpoint/conversion_ops.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>
#include <c10/core/WrapDimMinimal.h>
#include <c10/util/Exception.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "checkpoint/tensor_io.h"

namespace moefit::checkpoint {
namespace {

using Kind = ConversionOp::Kind;

absl::Status OpError(const ConversionOp& op, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(op.DebugString(), ": ", absl::string_view(what.data(), what.size())));
}

absl::StatusOr<at::Tensor> Single(const ConversionOp& op, const TensorGroups& groups) {
  if (groups.size() != 1 || groups[0].size() != 1) {
    return OpError(op, absl::StrCat("needs one tensor, got ", groups.size(),
                                    " group(s) (merge and concatenate first)"));
  }
  return groups[0][0];
}

// Swaps the two halves' roles: [2, n] <-> [n, 2] along `dim`.
at::Tensor Regroup(const at::Tensor& t, int64_t dim, bool interleave) {
  const int64_t wrapped = c10::maybe_wrap_dim(dim, t.dim());
  const int64_t size = t.size(wrapped);
  TORCH_CHECK(size % 2 == 0, "dim ", dim, " has odd size ", size);
  const int64_t half = size / 2;
  const std::vector<int64_t> split =
      interleave ? std::vector<int64_t>{2, half} : std::vector<int64_t>{half, 2};
  return t.unflatten(wrapped, split).transpose(wrapped, wrapped + 1).flatten(wrapped, wrapped + 1);
}

absl::StatusOr<TensorGroups> ApplyOne(const ConversionOp& op, TensorGroups groups) {
  switch (op.kind) {
    case Kind::kMergeModulelist: {
      TensorGroups out;
      for (const std::vector<at::Tensor>& group : groups) {
        if (group.empty()) return OpError(op, "no experts to merge");
        out.push_back({at::stack(group, op.dim)});
      }
      return out;
    }
    case Kind::kSplitModulelist: {
      TensorGroups out;
      for (const std::vector<at::Tensor>& group : groups) {
        if (group.size() != 1) return OpError(op, "needs one tensor per group");
        out.push_back(group[0].unbind(op.dim));
      }
      return out;
    }
    case Kind::kConcatenate: {
      std::vector<at::Tensor> parts;
      for (const std::vector<at::Tensor>& group : groups) {
        if (group.size() != 1) return OpError(op, "needs one tensor per source (merge first)");
        parts.push_back(group[0]);
      }
      return TensorGroups{{at::cat(parts, op.dim)}};
    }
    case Kind::kChunk: {
      absl::StatusOr<at::Tensor> t = Single(op, groups);
      if (!t.ok()) return t.status();
      const int64_t wrapped = c10::maybe_wrap_dim(op.dim, t->dim());
      if (op.num_chunks < 1 || t->size(wrapped) % op.num_chunks != 0) {
        return OpError(op, absl::StrCat("size ", t->size(wrapped), " of dim ", op.dim,
                                        " does not divide into ", op.num_chunks, " parts"));
      }
      TensorGroups out;
      for (at::Tensor& part : t->chunk(op.num_chunks, wrapped)) out.push_back({part});
      return out;
    }
    case Kind::kTranspose:
    case Kind::kInterleave:
    case Kind::kDeinterleave:
    case Kind::kCast: {
      for (std::vector<at::Tensor>& group : groups) {
        for (at::Tensor& t : group) {
          if (op.kind == Kind::kTranspose) {
            t = t.transpose(op.dim, op.dim1);
          } else if (op.kind == Kind::kCast) {
            const std::optional<at::ScalarType> type = ToScalarType(op.dtype);
            if (!type) return OpError(op, "torch has no such dtype");
            t = t.to(*type);
          } else {
            t = Regroup(t, op.dim, op.kind == Kind::kInterleave);
          }
        }
      }
      return groups;
    }
  }
  return OpError(op, "unknown op");
}

}  // namespace

absl::StatusOr<TensorGroups> ApplyOps(std::span<const ConversionOp> ops, TensorGroups groups) {
  for (const ConversionOp& op : ops) {
    try {
      absl::StatusOr<TensorGroups> next = ApplyOne(op, std::move(groups));
      if (!next.ok()) return next.status();
      groups = *std::move(next);
    } catch (const c10::Error& e) {
      return OpError(op, e.what_without_backtrace());
    }
  }
  return groups;
}

}  // namespace moefit::checkpoint
