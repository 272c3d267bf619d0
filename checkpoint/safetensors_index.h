// Sharded safetensors checkpoints: the index file and shard planning.
//
// Large models are stored as several safetensors files ("shards") next to a
// `model.safetensors.index.json` that maps every tensor to its shard:
//   {"metadata": {"total_size": N}, "weight_map": {"<tensor>": "<shard file>"}}
// with shards named `model-00001-of-00003.safetensors`. This is the layout the HF
// Hub and transformers' save_pretrained use, so moefit reads model directories
// as published and writes ones transformers loads. Torch-free, like
// safetensors.h.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moefit::checkpoint {

// Name of the index beside the shards, and of a checkpoint that fits one file.
inline constexpr std::string_view kIndexFileName = "model.safetensors.index.json";
inline constexpr std::string_view kSingleFileName = "model.safetensors";

struct ShardedIndex {
  // Sum of all tensors' byte sizes (not of the files, which add headers).
  uint64_t total_size = 0;
  // Tensor name -> shard file name (a plain file name, relative to the index).
  std::map<std::string, std::string> weight_map;

  // The distinct shard files, sorted.
  std::vector<std::string> ShardFiles() const;
};

// Parses index JSON; `name` is what messages call it. Errors (InvalidArgument)
// name the file and, where there is one, the tensor: malformed JSON, duplicate
// keys, a missing or non-object "weight_map", a shard that is not a string or
// not a plain file name (no directories, so an index cannot point outside its
// folder), a "total_size" that is not a non-negative integer. Other "metadata"
// fields are ignored.
absl::StatusOr<ShardedIndex> ParseShardedIndex(std::string_view json_text, std::string_view name);

// Reads and parses the index at `path`.
absl::StatusOr<ShardedIndex> ReadShardedIndex(const std::filesystem::path& path);

// Writes `index` to `path` (indented, keys sorted, like transformers), through
// `<path>.tmp`, fsync and rename, as SafetensorsWriter does.
absl::Status WriteShardedIndex(const std::filesystem::path& path, const ShardedIndex& index);

// "<prefix>-00002-of-00003.safetensors" for shard_idx 1 of num_shards 3.
std::string ShardFileName(int shard_idx, int num_shards, std::string_view prefix = "model");

// One tensor to place: its name and size in bytes.
struct TensorSize {
  std::string name;
  uint64_t num_bytes = 0;
};

struct ShardPlanOptions {
  // Largest shard, in bytes of tensor data. A tensor bigger than this gets a
  // shard of its own (tensors are never split). transformers' default is 5 GB.
  uint64_t max_shard_bytes = 5'000'000'000;
  // File names are "<prefix>-0000i-of-0000n.safetensors", or
  // "<prefix>.safetensors" when one shard holds everything.
  std::string prefix = "model";
};

struct ShardPlan {
  std::vector<std::string> shard_files;                 // in shard order
  std::vector<std::vector<std::string>> shard_tensors;  // tensor names per shard, in input order
  ShardedIndex index;                                   // ready to write beside the shards
  // False when everything fits one file; the index is then optional (transformers
  // writes none).
  bool needs_index() const { return shard_files.size() > 1; }
};

// Fills shards greedily in the order given: a tensor starts a new shard when it
// would push the current one past max_shard_bytes. Keeping the caller's order
// keeps related tensors (one layer, one expert) together. Errors: max_shard_bytes
// of 0, an empty or duplicate tensor name.
absl::StatusOr<ShardPlan> PlanShards(std::span<const TensorSize> tensors,
                                     const ShardPlanOptions& options = {});

}  // namespace moefit::checkpoint
