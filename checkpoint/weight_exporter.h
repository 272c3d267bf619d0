// Exporting runtime tensors as a Hub checkpoint directory (the reverse of weight_loader.h).
//
// Each rank holds the dense tensors and a slice of every layer's packed experts;
// the directory on disk must look like what the Hub publishes (per-expert keys
// with GLOBAL expert numbers, sharded `model-0000k-of-0000N.safetensors` files and
// a `model.safetensors.index.json`), so that transformers (old and new) and vLLM
// read it. Every rule of the family's table runs backwards (split the experts,
// chunk gate from up, undo transposes and interleaving), which yields views, not
// copies; bytes are made contiguous one shard at a time while writing.
//
// checkpoint/ knows nothing of MPI, so the collective part is left to the
// caller, in three steps:
//   1. every rank: plan = PlanExport(...)   -> its shard count and sizes;
//   2. the caller all-gathers plan.num_shards(); rank r's first shard index is
//      the sum over ranks before it, N the total; every rank:
//      fragment = WriteExportShards(dir, plan, first_shard_idx, N);
//   3. the caller gathers the fragments and the total size on one rank, which
//      calls WriteIndex(dir, merged weight map, total size).
// Dense tensors are written by the rank whose options say write_dense, experts
// by their owners. SaveCheckpoint does all three in one process.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/mapping_table.h"

namespace moefit::checkpoint {

struct ExportOptions {
  // Global index of local expert 0 in this rank's expert tensors.
  int64_t first_expert = 0;
  // Whether this rank writes the non-expert tensors (exactly one rank should).
  bool write_dense = true;
  // When set, packed-on-disk expert tensors (gpt-oss style) are checked to hold
  // all experts: one rank cannot write part of a single on-disk tensor.
  std::optional<int64_t> num_global_experts;
  // Largest shard, in bytes of tensor data (transformers' default is 5 GB).
  uint64_t max_shard_bytes = 5'000'000'000;
  // Floating-point tensors are written in this dtype (e.g. BF16 from F32 master
  // weights); nullopt keeps each tensor's dtype.
  std::optional<at::ScalarType> dtype;
  // fsync files and directory (only throwaway test output should turn it off).
  bool sync = true;
};

// One on-disk tensor (often a view of a runtime tensor).
struct ExportTensor {
  std::string name;
  at::Tensor tensor;
};

// This rank's part of an export.
struct ExportPlan {
  std::vector<std::vector<ExportTensor>> shards;  // tensors per local shard, natural order
  std::vector<uint64_t> shard_bytes;              // tensor bytes per local shard
  uint64_t total_bytes = 0;                       // sum of shard_bytes
  std::optional<at::ScalarType> dtype;            // from the options
  std::set<std::string> keep_float32;             // on-disk names written in float32
  bool sync = true;

  int num_shards() const { return static_cast<int>(shards.size()); }
};

// Step 1: maps `tensors` (runtime names) to on-disk tensors with `table` and
// plans them into shards of at most options.max_shard_bytes. Errors
// (InvalidArgument) name the runtime tensor: one no rule's target matches, an
// expert tensor whose dim 0 does not fit, a shape the reverse ops reject, or two
// tensors giving the same on-disk name.
absl::StatusOr<ExportPlan> PlanExport(const MappingTable& table,
                                      const std::map<std::string, at::Tensor>& tensors,
                                      const ExportOptions& options = {});
absl::StatusOr<ExportPlan> PlanExport(std::string_view family,
                                      const std::map<std::string, at::Tensor>& tensors,
                                      const ExportOptions& options = {});

// Step 2: writes the plan's shards as global shards first_shard_idx,
// first_shard_idx + 1, ... of num_total_shards into `dir` (created if needed),
// each through a temporary file and a rename. With num_total_shards == 1 the
// file is model.safetensors. Returns this rank's weight_map fragment
// (on-disk name -> shard file name).
absl::StatusOr<std::map<std::string, std::string>> WriteExportShards(
    const std::filesystem::path& dir, const ExportPlan& plan, int first_shard_idx,
    int num_total_shards);

// Step 3 (one rank): writes model.safetensors.index.json for the merged map.
// `total_size` is the sum of every rank's plan.total_bytes.
absl::Status WriteIndex(const std::filesystem::path& dir,
                        const std::map<std::string, std::string>& weight_map, uint64_t total_size);

// All three steps in one process, for a process that holds every tensor
// (first_expert 0, write_dense). Writes no index when everything fits one file,
// as transformers does.
absl::Status SaveCheckpoint(const std::filesystem::path& dir, std::string_view family,
                            const std::map<std::string, at::Tensor>& tensors,
                            const ExportOptions& options = {});
absl::Status SaveCheckpoint(const std::filesystem::path& dir, const MappingTable& table,
                            const std::map<std::string, at::Tensor>& tensors,
                            const ExportOptions& options = {});

}  // namespace moefit::checkpoint
