// model.safetensors.index.json reading/writing and shard planning (see safetensors_index.h).
#include "checkpoint/safetensors_index.h"

#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/internal/file_io.h"
#include "checkpoint/internal/json.h"
#include "checkpoint/internal/strings.h"
#include "nlohmann/json.hpp"

namespace moefit::checkpoint {
namespace {

using Json = nlohmann::ordered_json;

// A shard must sit beside the index: no directory parts, no "." or "..".
bool IsPlainFileName(std::string_view file) {
  return !file.empty() && file != "." && file != ".." && file.find('/') == std::string_view::npos &&
         file.find('\\') == std::string_view::npos && file.find('\0') == std::string_view::npos;
}

// total_size is written as an integer by transformers, but some tools write a
// float; accept any non-negative integral value that fits.
bool ToByteCount(const Json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return true;
  }
  if (value.is_number_float()) {
    const double d = value.get<double>();
    if (d >= 0 && d < 0x1p64 && std::floor(d) == d) {
      *out = static_cast<uint64_t>(d);
      return true;
    }
  }
  return false;
}

}  // namespace

std::vector<std::string> ShardedIndex::ShardFiles() const {
  std::set<std::string> files;
  for (const auto& [tensor, file] : weight_map) files.insert(file);
  return {files.begin(), files.end()};
}

absl::StatusOr<ShardedIndex> ParseShardedIndex(std::string_view json_text,
                                               std::string_view file_name) {
  const absl::string_view name = internal::AsAbsl(file_name);
  absl::StatusOr<Json> json = internal::ParseJsonRejectingDuplicates(json_text, file_name);
  if (!json.ok()) return json.status();
  auto error = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", parts...));
  };
  if (!json->is_object()) return error("not a JSON object");

  ShardedIndex index;
  const auto metadata_it = json->find("metadata");
  if (metadata_it != json->end() && !metadata_it->is_null()) {
    if (!metadata_it->is_object()) return error("\"metadata\" is not a JSON object");
    const auto total_it = metadata_it->find("total_size");
    if (total_it != metadata_it->end() && !ToByteCount(*total_it, &index.total_size)) {
      return error("\"metadata.total_size\" = ", total_it->dump(),
                   " is not a non-negative integer");
    }
  }

  const auto map_it = json->find("weight_map");
  if (map_it == json->end() || !map_it->is_object()) {
    return error("missing JSON object \"weight_map\"");
  }
  for (const auto& [tensor, file] : map_it->items()) {
    if (!file.is_string()) {
      return error("tensor \"", tensor, "\": shard ", file.dump(), " is not a string");
    }
    const std::string& file_name = file.get_ref<const std::string&>();
    if (!IsPlainFileName(file_name)) {
      return error("tensor \"", tensor, "\": shard \"", file_name,
                   "\" is not a plain file name beside the index");
    }
    index.weight_map.emplace(tensor, file_name);
  }
  return index;
}

absl::StatusOr<ShardedIndex> ReadShardedIndex(const std::filesystem::path& path) {
  absl::StatusOr<std::string> text = internal::ReadFileToString(path);
  if (!text.ok()) return text.status();
  return ParseShardedIndex(*text, path.string());
}

absl::Status WriteShardedIndex(const std::filesystem::path& path, const ShardedIndex& index) {
  for (const auto& [tensor, file] : index.weight_map) {
    if (!IsPlainFileName(file)) {
      return absl::InvalidArgumentError(absl::StrCat(path.string(), ": tensor \"", tensor,
                                                     "\": shard \"", file,
                                                     "\" is not a plain file name"));
    }
  }
  Json json = Json::object();
  json["metadata"] = Json::object({{"total_size", index.total_size}});
  Json weight_map = Json::object();
  for (const auto& [tensor, file] : index.weight_map)
    weight_map[tensor] = file;  // sorted: std::map
  json["weight_map"] = std::move(weight_map);
  std::string text;
  try {
    text = json.dump(2) + "\n";
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), ": index cannot be written: ", e.what()));
  }
  const std::span<const std::byte> parts[] = {std::as_bytes(std::span(text))};
  return internal::WriteFileAtomically(path, parts, /*sync=*/true);
}

std::string ShardFileName(int shard_idx, int num_shards, std::string_view prefix) {
  return absl::StrFormat("%s-%05d-of-%05d.safetensors", internal::AsAbsl(prefix), shard_idx + 1,
                         num_shards);
}

absl::StatusOr<ShardPlan> PlanShards(std::span<const TensorSize> tensors,
                                     const ShardPlanOptions& options) {
  if (options.max_shard_bytes == 0) {
    return absl::InvalidArgumentError("PlanShards: max_shard_bytes must be positive");
  }
  ShardPlan plan;
  std::set<std::string_view> seen;
  uint64_t shard_bytes = 0;
  for (const TensorSize& tensor : tensors) {
    if (tensor.name.empty()) return absl::InvalidArgumentError("PlanShards: empty tensor name");
    if (!seen.insert(tensor.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("PlanShards: tensor \"", tensor.name, "\" listed twice"));
    }
    // A shard with data in it takes no tensor that would push it past the limit;
    // an empty one takes anything, so an oversized tensor gets a shard alone.
    const bool overflows = tensor.num_bytes > options.max_shard_bytes ||
                           shard_bytes > options.max_shard_bytes - tensor.num_bytes;
    if (plan.shard_tensors.empty() || (shard_bytes > 0 && overflows)) {
      plan.shard_tensors.emplace_back();
      shard_bytes = 0;
    }
    plan.shard_tensors.back().push_back(tensor.name);
    shard_bytes += tensor.num_bytes;
    plan.index.total_size += tensor.num_bytes;
  }

  const int num_shards = static_cast<int>(plan.shard_tensors.size());
  for (int shard_idx = 0; shard_idx < num_shards; ++shard_idx) {
    plan.shard_files.push_back(num_shards == 1
                                   ? absl::StrCat(options.prefix, ".safetensors")
                                   : ShardFileName(shard_idx, num_shards, options.prefix));
    for (const std::string& tensor : plan.shard_tensors[shard_idx]) {
      plan.index.weight_map.emplace(tensor, plan.shard_files.back());
    }
  }
  return plan;
}

}  // namespace moefit::checkpoint
