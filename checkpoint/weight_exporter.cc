// Export of runtime tensors to a Hub checkpoint directory (see weight_exporter.h).
//
// Planning runs each rule's reverse ops on the runtime tensors; for the usual
// families that is split + chunk, i.e. views, so a plan costs no memory. Bytes
// are materialized (contiguous, converted) shard by shard in AddTensor while
// writing, so the extra memory of an export is one shard.
#include "checkpoint/weight_exporter.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "checkpoint/conversion_ops.h"
#include "checkpoint/internal/strings.h"
#include "checkpoint/natural_order.h"
#include "checkpoint/safetensors_index.h"
#include "checkpoint/tensor_io.h"
#include "proto/status_macros.h"

namespace moefit::checkpoint {
namespace {

using internal::AsAbsl;

// The rule whose target matches `name`, and the target's `*` values.
const MappingRule* FindRule(const MappingTable& table, const std::string& name,
                            std::vector<int64_t>& numbers) {
  for (const MappingRule& rule : table.rules) {
    std::optional<std::vector<int64_t>> matched = rule.target.Match(name);
    if (matched) {
      numbers = *std::move(matched);
      return &rule;
    }
  }
  return nullptr;
}

uint64_t ExportBytes(const at::Tensor& t, std::optional<at::ScalarType> dtype) {
  const at::ScalarType type =
      dtype && at::isFloatingType(t.scalar_type()) ? *dtype : t.scalar_type();
  return static_cast<uint64_t>(t.numel()) * c10::elementSize(type);
}

}  // namespace

absl::StatusOr<ExportPlan> PlanExport(const MappingTable& table,
                                      const std::map<std::string, at::Tensor>& tensors,
                                      const ExportOptions& options) {
  std::map<std::string, at::Tensor, NaturalLessCompare> on_disk;
  for (const auto& [name, tensor] : tensors) {
    std::vector<int64_t> numbers;
    const MappingRule* rule = FindRule(table, name, numbers);
    if (rule == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("export as ", table.family, ": tensor \"",
                                                     name, "\" matches no rule of ", table.file));
    }
    if (!rule->is_expert_rule() && !options.write_dense) continue;
    if (!tensor.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("export as ", table.family, ": tensor \"", name, "\" is undefined"));
    }
    if (rule->packed_experts) {
      const int64_t num_local = tensor.dim() > 0 ? tensor.size(0) : 0;
      if (options.first_expert != 0 ||
          (options.num_global_experts && *options.num_global_experts != num_local)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "export as ", table.family, ": tensor \"", name,
            "\" is stored packed on disk, so one rank must hold all its experts (this rank holds ",
            num_local, " from expert ", options.first_expert, ")"));
      }
    }
    const std::vector<ConversionOp> reverse = rule->ReverseOps();
    absl::StatusOr<TensorGroups> groups = ApplyOps(reverse, TensorGroups{{tensor}});
    if (!groups.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("export as ", table.family, ": tensor \"",
                                                     name, "\": ", groups.status().message()));
    }
    if (groups->size() != rule->sources.size()) {
      return absl::InternalError(absl::StrCat(table.file, ":", rule->line, ": reverse ops give ",
                                              groups->size(), " tensors for ", rule->sources.size(),
                                              " sources"));
    }
    for (size_t pattern_idx = 0; pattern_idx < groups->size(); ++pattern_idx) {
      const std::vector<at::Tensor>& group = (*groups)[pattern_idx];
      for (size_t local_idx = 0; local_idx < group.size(); ++local_idx) {
        std::vector<int64_t> source_numbers = numbers;
        if (rule->merges_experts()) {
          source_numbers.push_back(options.first_expert + static_cast<int64_t>(local_idx));
        }
        std::string source_name = rule->sources[pattern_idx].Fill(source_numbers);
        auto [it, inserted] = on_disk.emplace(source_name, group[local_idx]);
        if (!inserted) {
          return absl::InvalidArgumentError(absl::StrCat("export as ", table.family, ": tensor \"",
                                                         name, "\" gives \"", source_name,
                                                         "\" which another tensor also gives"));
        }
      }
    }
  }

  ExportPlan plan;
  plan.dtype = options.dtype;
  for (const auto& [name, tensor] : on_disk) {
    for (const KeyPattern& p : table.keep_float32) {
      if (p.Match(name)) plan.keep_float32.insert(name);
    }
  }
  // The dtype a tensor is written in: kept tensors in float32.
  auto dtype_of = [&](const std::string& name) -> std::optional<at::ScalarType> {
    if (plan.dtype && plan.keep_float32.contains(name)) return at::kFloat;
    return plan.dtype;
  };
  std::vector<TensorSize> sizes;
  sizes.reserve(on_disk.size());
  for (const auto& [name, tensor] : on_disk)
    sizes.push_back({name, ExportBytes(tensor, dtype_of(name))});
  plan.sync = options.sync;
  if (sizes.empty()) return plan;
  MOEFIT_ASSIGN_OR_RETURN(ShardPlan shards,
                          PlanShards(sizes, {.max_shard_bytes = options.max_shard_bytes}));
  for (const std::vector<std::string>& shard_names : shards.shard_tensors) {
    std::vector<ExportTensor>& shard = plan.shards.emplace_back();
    uint64_t num_bytes = 0;
    for (const std::string& name : shard_names) {
      const at::Tensor& tensor = on_disk.at(name);
      num_bytes += ExportBytes(tensor, dtype_of(name));
      shard.push_back({name, tensor});
    }
    plan.shard_bytes.push_back(num_bytes);
    plan.total_bytes += num_bytes;
  }
  return plan;
}

absl::StatusOr<ExportPlan> PlanExport(std::string_view family,
                                      const std::map<std::string, at::Tensor>& tensors,
                                      const ExportOptions& options) {
  MOEFIT_ASSIGN_OR_RETURN(MappingTable table, MappingTableFor(family));
  return PlanExport(table, tensors, options);
}

absl::StatusOr<std::map<std::string, std::string>> WriteExportShards(
    const std::filesystem::path& dir, const ExportPlan& plan, int first_shard_idx,
    int num_total_shards) {
  if (first_shard_idx < 0 || first_shard_idx + plan.num_shards() > num_total_shards) {
    return absl::InvalidArgumentError(absl::StrCat(dir.string(), ": shards [", first_shard_idx,
                                                   ", ", first_shard_idx + plan.num_shards(),
                                                   ") do not fit ", num_total_shards));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir.string(), ": ", ec.message()));
  std::map<std::string, std::string> weight_map;
  for (int shard_idx = 0; shard_idx < plan.num_shards(); ++shard_idx) {
    const std::string file_name =
        num_total_shards == 1 ? std::string(kSingleFileName)
                              : ShardFileName(first_shard_idx + shard_idx, num_total_shards);
    SafetensorsWriter writer(dir / file_name, {.sync = plan.sync});
    for (const ExportTensor& t : plan.shards[shard_idx]) {
      at::Tensor tensor = t.tensor;
      if (plan.dtype && at::isFloatingType(tensor.scalar_type())) {
        try {
          tensor = tensor.to(plan.keep_float32.contains(t.name) ? at::kFloat : *plan.dtype);
        } catch (const c10::Error& e) {
          return absl::InvalidArgumentError(absl::StrCat((dir / file_name).string(), ": tensor \"",
                                                         t.name,
                                                         "\": ", e.what_without_backtrace()));
        }
      }
      MOEFIT_RETURN_IF_ERROR(AddTensor(writer, t.name, tensor));
      weight_map.emplace(t.name, file_name);
    }
    MOEFIT_RETURN_IF_ERROR(writer.Finish());
  }
  return weight_map;
}

absl::Status WriteIndex(const std::filesystem::path& dir,
                        const std::map<std::string, std::string>& weight_map, uint64_t total_size) {
  ShardedIndex index;
  index.weight_map = weight_map;
  index.total_size = total_size;
  return WriteShardedIndex(dir / std::string(kIndexFileName), index);
}

absl::Status SaveCheckpoint(const std::filesystem::path& dir, const MappingTable& table,
                            const std::map<std::string, at::Tensor>& tensors,
                            const ExportOptions& options) {
  MOEFIT_ASSIGN_OR_RETURN(ExportPlan plan, PlanExport(table, tensors, options));
  const int num_shards = std::max(plan.num_shards(), 1);
  MOEFIT_ASSIGN_OR_RETURN(auto weight_map, WriteExportShards(dir, plan, 0, num_shards));
  if (num_shards == 1) return absl::OkStatus();
  return WriteIndex(dir, weight_map, plan.total_bytes);
}

absl::Status SaveCheckpoint(const std::filesystem::path& dir, std::string_view family,
                            const std::map<std::string, at::Tensor>& tensors,
                            const ExportOptions& options) {
  MOEFIT_ASSIGN_OR_RETURN(MappingTable table, MappingTableFor(family));
  return SaveCheckpoint(dir, table, tensors, options);
}

}  // namespace moefit::checkpoint
