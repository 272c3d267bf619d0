// The inspect command; see inspect_command.h.
#include "launch/inspect_command.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string_view>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/compressed_tensors.h"
#include "checkpoint/fp8.h"
#include "checkpoint/natural_order.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_io.h"
#include "checkpoint/training_manifest.h"
#include "proto/status_macros.h"

namespace moefit::launch {
namespace {

namespace fs = std::filesystem;

struct Group {
  int64_t count = 0;
  int64_t numel = 0;
  uint64_t bytes = 0;
  std::set<std::string> dtypes, shapes;
};

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// "model.layers.12.mlp.experts.7.up_proj.weight" -> "model.layers.*.mlp.experts.*.up_proj.weight"
std::string Pattern(const std::string& name) {
  static const std::regex kNumber("\\.[0-9]+(?=\\.|$)");
  return std::regex_replace(name, kNumber, ".*");
}

std::string Count(double n) {
  if (n >= 1e9) return absl::StrFormat("%.2fB", n / 1e9);
  if (n >= 1e6) return absl::StrFormat("%.2fM", n / 1e6);
  if (n >= 1e3) return absl::StrFormat("%.1fK", n / 1e3);
  return absl::StrFormat("%.0f", n);
}

std::string Bytes(double n) {
  if (n >= 1e9) return absl::StrFormat("%.2f GB", n / 1e9);
  if (n >= 1e6) return absl::StrFormat("%.2f MB", n / 1e6);
  if (n >= 1e3) return absl::StrFormat("%.1f KB", n / 1e3);
  return absl::StrFormat("%.0f bytes", n);
}

// Routed experts only: `mlp.shared_experts.*` (deepseek_v3, glm4_moe) and
// `mlp.shared_expert.*` (qwen2_moe) do not match, as they run for every token.
bool IsExpertTensor(const std::string& name) { return name.find(".experts.") != std::string::npos; }

// Tensors stored with the weights that transformers does not count as
// parameters: FP8 block scales and compressed-tensors' scales, zero points and
// shapes (consumed by dequantization), and buffers.
bool IsScaleTensor(const std::string& name) {
  return absl::EndsWith(name, std::string(checkpoint::kScaleInvSuffix));
}
// The compressed-tensors companion suffix `name` ends with ("weight_scale",
// ...), or empty.
std::string CompressedTensorsCompanion(const std::string& name) {
  for (std::string_view suffix :
       {checkpoint::kScaleSuffix, checkpoint::kZeroPointSuffix, checkpoint::kShapeSuffix}) {
    const std::string companion = ".weight" + std::string(suffix);
    if (absl::EndsWith(name, companion)) return companion.substr(1);
  }
  return "";
}
bool IsPackedWeight(const std::string& name) {
  return absl::EndsWith(name, ".weight" + std::string(checkpoint::kPackedSuffix));
}

// The product of an integer shape tensor's values (`X.weight_shape`), read
// from the file; nullopt when it is not a 1-D I32 / I64 tensor.
std::optional<int64_t> ShapeNumel(const checkpoint::SafetensorsFile& file,
                                  const checkpoint::TensorInfo& t) {
  if ((t.dtype != checkpoint::Dtype::kI64 && t.dtype != checkpoint::Dtype::kI32) ||
      t.shape.size() != 1) {
    return std::nullopt;
  }
  absl::StatusOr<at::Tensor> shape = checkpoint::ReadTensor(file, t, {.dtype = at::kLong});
  if (!shape.ok()) return std::nullopt;
  return shape->prod().item<int64_t>();
}

// One group of config.json's compressed-tensors quantization_config, as
// "pack-quantized int4, group 32, symmetric" (the library's defaults where
// the group leaves a field out).
std::string DescribeScheme(const nlohmann::json& scheme, const std::string& default_format) {
  const nlohmann::json none = nlohmann::json::object();
  const nlohmann::json& w =
      scheme.contains("weights") && scheme["weights"].is_object() ? scheme["weights"] : none;
  auto value = [&](const nlohmann::json& j, const char* key) -> const nlohmann::json* {
    return j.contains(key) && !j[key].is_null() ? &j[key] : nullptr;
  };
  const nlohmann::json* format = value(scheme, "format");
  std::string out =
      format != nullptr && format->is_string() ? format->get<std::string>() : default_format;
  if (w.empty()) return out + ", weights not quantized";
  const nlohmann::json* type = value(w, "type");
  const nlohmann::json* bits = value(w, "num_bits");
  const nlohmann::json* group_size = value(w, "group_size");
  const nlohmann::json* strategy = value(w, "strategy");
  const nlohmann::json* symmetric = value(w, "symmetric");
  const nlohmann::json* block = value(w, "block_structure");
  absl::StrAppend(&out, " ",
                  type != nullptr && type->is_string() ? type->get<std::string>() : "int",
                  bits != nullptr ? bits->dump() : "8");
  std::string kind =
      strategy != nullptr && strategy->is_string() ? strategy->get<std::string>() : "";
  if (kind.empty()) {
    kind = group_size != nullptr && group_size->is_number_integer() && *group_size == -1 ? "channel"
           : group_size != nullptr                                                       ? "group"
                                                                                         : "tensor";
  }
  if (kind == "group") {
    absl::StrAppend(&out, ", group ", group_size != nullptr ? group_size->dump() : "?");
  } else if (kind == "block") {
    absl::StrAppend(&out, ", blocks ", block != nullptr ? block->dump() : "?");
  } else {
    absl::StrAppend(&out, ", per ", kind);
  }
  const bool sym = symmetric == nullptr || !symmetric->is_boolean() || symmetric->get<bool>();
  absl::StrAppend(&out, sym ? ", symmetric" : ", asymmetric");
  if (const nlohmann::json* targets = value(scheme, "targets"); targets && targets->is_array()) {
    std::vector<std::string> names;
    for (const auto& t : *targets) names.push_back(t.is_string() ? t.get<std::string>() : t.dump());
    absl::StrAppend(&out, " (targets ", absl::StrJoin(names, ", "), ")");
  }
  return out;
}

// config.json's quantization_config in one line; empty without one.
std::string DescribeQuantization(const nlohmann::json& config) {
  if (!config.is_object() || !config.contains("quantization_config") ||
      !config["quantization_config"].is_object()) {
    return "";
  }
  const nlohmann::json& q = config["quantization_config"];
  const std::string method = q.value("quant_method", std::string("?"));
  if (method == "fp8") {
    return absl::StrCat(
        "fp8 ", q.value("fmt", std::string("e4m3")), ", blocks ",
        q.contains("weight_block_size") ? q["weight_block_size"].dump() : "[128, 128]");
  }
  if (method != "compressed-tensors") return method;
  const std::string format = q.contains("format") && q["format"].is_string()
                                 ? q["format"].get<std::string>()
                                 : "(no format)";
  std::vector<std::string> groups;
  if (q.contains("config_groups") && q["config_groups"].is_object()) {
    for (const auto& [name, scheme] : q["config_groups"].items()) {
      groups.push_back(DescribeScheme(scheme, format));
    }
  }
  std::string out = absl::StrCat("compressed-tensors ", absl::StrJoin(groups, "; "));
  if (q.contains("ignore") && q["ignore"].is_array() && !q["ignore"].empty()) {
    std::vector<std::string> ignored;
    for (const auto& i : q["ignore"])
      ignored.push_back(i.is_string() ? i.get<std::string>() : i.dump());
    absl::StrAppend(&out, "; not quantized: ", absl::StrJoin(ignored, ", "));
  }
  return out;
}
bool IsBufferTensor(const std::string& name) {
  return absl::EndsWith(name, ".e_score_correction_bias") ||
         absl::EndsWith(name, ".rotary_emb.inv_freq");
}

int64_t IntOr(const nlohmann::json& config, const char* key, int64_t fallback) {
  return config.is_object() && config.contains(key) && config[key].is_number_integer()
             ? config[key].get<int64_t>()
             : fallback;
}

}  // namespace

absl::Status RunInspect(const std::string& path, std::ostream& out) {
  std::error_code ec;
  std::vector<fs::path> files;
  nlohmann::json config;
  if (fs::is_directory(path, ec)) {
    for (const auto& entry : fs::directory_iterator(path, ec)) {
      if (entry.path().extension() == ".safetensors") files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end(), [](const fs::path& a, const fs::path& b) {
      return checkpoint::NaturalLess(a.filename().string(), b.filename().string());
    });
    const fs::path cfg = fs::path(path) / "config.json";
    if (fs::exists(cfg)) {
      std::ifstream in(cfg);
      config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
      if (config.is_discarded() || !config.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(cfg.string(), ": not a JSON object"));
      }
    }
    if (files.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": no .safetensors files"));
    }
    if (fs::exists(fs::path(path) / checkpoint::kManifestName)) {
      // A training checkpoint: what its manifest says, then its tensors (the
      // AdamW moments and generator states count among them).
      absl::StatusOr<proto::TrainingCheckpointManifest> m = checkpoint::ReadManifest(path);
      if (!m.ok()) return m.status();
      out << path << ": training checkpoint after step " << m->step() << " (mode " << m->mode()
          << "), saved by " << m->layout().world_size() << " processes, " << m->layout().ep_size()
          << " expert-parallel ranks; " << m->files_size() << " files listed" << std::endl;
    }
  } else if (fs::exists(path, ec)) {
    files.push_back(path);
  } else {
    return absl::NotFoundError(absl::StrCat("inspect: no such file or directory '", path, "'"));
  }

  // Multi-token-prediction modules (DeepSeek-V3's model.layers.61, GLM-4.5's
  // model.layers.92) follow the decoder layers; transformers builds no module
  // for them, so they are no parameters of the model.
  const int64_t num_hidden_layers = IntOr(config, "num_hidden_layers", -1);
  const int64_t num_mtp_layers =
      IntOr(config, "num_nextn_predict_layers", IntOr(config, "num_mtp_layers", 0));
  // Layers from here on are MTP layers (none when the config has none).
  const int64_t mtp_from = num_hidden_layers >= 0 && num_mtp_layers > 0
                               ? num_hidden_layers
                               : std::numeric_limits<int64_t>::max();

  // Every tensor's header entry, and the logical element count of each packed
  // int4 weight (`X.weight_shape`, which may sit in another file than its
  // `X.weight_packed`): 8 values per stored int32, up to the row's end.
  std::vector<checkpoint::TensorInfo> infos;
  std::map<std::string, int64_t> logical_numel;  // by "X.weight"
  for (const fs::path& f : files) {
    MOEFIT_ASSIGN_OR_RETURN(checkpoint::SafetensorsFile file, checkpoint::SafetensorsFile::Open(f));
    for (const checkpoint::TensorInfo& t : file.tensors()) {
      infos.push_back(t);
      if (CompressedTensorsCompanion(t.name) == "weight_shape") {
        if (const std::optional<int64_t> numel = ShapeNumel(file, t)) {
          logical_numel[t.name.substr(0, t.name.size() - checkpoint::kShapeSuffix.size())] = *numel;
        }
      }
    }
  }

  std::map<std::string, Group> groups;
  std::vector<std::string> order;
  std::map<std::string, int64_t> numel_by_dtype;
  int64_t total = 0, expert_total = 0, num_tensors = 0;
  int64_t mtp_total = 0, scale_total = 0, num_scales = 0, buffer_total = 0, num_buffers = 0;
  int64_t companion_total = 0, num_companions = 0;
  uint64_t total_bytes = 0;
  std::set<int64_t> moe_layers, layers, mtp_layers;
  std::set<std::string> buffer_kinds;     // last name component, for the message
  std::set<std::string> companion_kinds;  // "weight_scale", ...
  static const std::regex kLayer("layers\\.([0-9]+)\\.");
  for (const checkpoint::TensorInfo& t : infos) {
    const std::string pattern = Pattern(t.name);
    Group& g = groups[pattern];
    if (g.count == 0) order.push_back(pattern);
    g.count += 1;
    g.numel += t.numel;
    g.bytes += t.num_bytes();
    g.dtypes.insert(std::string(checkpoint::DtypeName(t.dtype)));
    g.shapes.insert(ShapeString(t.shape));
    total_bytes += t.num_bytes();
    ++num_tensors;
    std::smatch m;
    const bool in_layer = std::regex_search(t.name, m, kLayer);
    const int64_t layer_idx = in_layer ? std::stoll(m[1]) : -1;
    const std::string companion = CompressedTensorsCompanion(t.name);
    // A packed int4 weight counts its values, not its words.
    int64_t numel = t.numel;
    std::string dtype(checkpoint::DtypeName(t.dtype));
    if (IsPackedWeight(t.name)) {
      const auto it =
          logical_numel.find(t.name.substr(0, t.name.size() - checkpoint::kPackedSuffix.size()));
      numel = it != logical_numel.end() ? it->second : t.numel * checkpoint::kInt4PerWord;
      dtype = "int4";
    }
    if (in_layer && layer_idx >= mtp_from) {
      mtp_layers.insert(layer_idx);
      if (!IsScaleTensor(t.name) && companion.empty() && !IsBufferTensor(t.name)) {
        mtp_total += numel;
      }
      continue;
    }
    if (IsScaleTensor(t.name)) {
      scale_total += t.numel;
      ++num_scales;
      continue;
    }
    if (!companion.empty()) {
      companion_total += t.numel;
      ++num_companions;
      companion_kinds.insert(companion);
      continue;
    }
    if (IsBufferTensor(t.name)) {
      buffer_total += t.numel;
      ++num_buffers;
      buffer_kinds.insert(t.name.substr(t.name.rfind('.') + 1));
      continue;
    }
    numel_by_dtype[dtype] += numel;
    total += numel;
    if (in_layer) {
      layers.insert(layer_idx);
      if (IsExpertTensor(t.name)) moe_layers.insert(layer_idx);
    }
    if (IsExpertTensor(t.name)) expert_total += numel;
  }
  std::sort(order.begin(), order.end(), checkpoint::NaturalLess);

  out << absl::StrFormat("%s: %d tensors in %d file%s, %s\n", path, num_tensors, files.size(),
                         files.size() == 1 ? "" : "s", Bytes(static_cast<double>(total_bytes)));
  int64_t num_experts = 0, top_k = 0;
  if (!config.is_null()) {
    for (const char* key : {"num_experts", "num_local_experts", "n_routed_experts"}) {
      if (config.contains(key) && config[key].is_number_integer()) num_experts = config[key];
    }
    if (config.contains("num_experts_per_tok") &&
        config["num_experts_per_tok"].is_number_integer()) {
      top_k = config["num_experts_per_tok"];
    }
    out << absl::StrFormat(
        "config.json: model_type %s, %s layers, hidden %s, %d experts, top-%d\n",
        config.value("model_type", std::string("?")),
        config.contains("num_hidden_layers") ? config["num_hidden_layers"].dump() : "?",
        config.contains("hidden_size") ? config["hidden_size"].dump() : "?", num_experts, top_k);
    if (const std::string quantization = DescribeQuantization(config); !quantization.empty()) {
      out << "quantization: " << quantization << "\n";
    }
  }
  std::vector<std::string> dtypes;
  for (const auto& [d, n] : numel_by_dtype) dtypes.push_back(absl::StrCat(d, " ", Count(n)));
  out << "parameters: " << Count(static_cast<double>(total)) << " total ("
      << absl::StrJoin(dtypes, ", ") << ")";
  if (num_experts > 0 && top_k > 0) {
    const double active = static_cast<double>(total - expert_total) +
                          static_cast<double>(expert_total) * top_k / num_experts;
    out << ", " << Count(active) << " active per token (routed experts " << Count(expert_total)
        << ", of which " << top_k << "/" << num_experts << " active)";
  }
  out << "\n";
  if (num_scales > 0 || num_companions > 0 || num_buffers > 0) {
    std::vector<std::string> parts;
    if (num_scales > 0) {
      parts.push_back(absl::StrCat(Count(static_cast<double>(scale_total)), " in ", num_scales,
                                   " FP8 block scales (*_scale_inv)"));
    }
    if (num_companions > 0) {
      std::vector<std::string> kinds;
      for (const std::string& kind : companion_kinds) kinds.push_back("*." + kind);
      parts.push_back(absl::StrCat(Count(static_cast<double>(companion_total)), " in ",
                                   num_companions, " quantization scales, zero points and shapes (",
                                   absl::StrJoin(kinds, ", "), ")"));
    }
    if (num_buffers > 0) {
      parts.push_back(absl::StrCat(Count(static_cast<double>(buffer_total)), " in ", num_buffers,
                                   " buffers (", absl::StrJoin(buffer_kinds, ", "), ")"));
    }
    out << "not parameters: " << absl::StrJoin(parts, "; ") << "\n";
  }
  if (!mtp_layers.empty()) {
    out << absl::StrFormat(
        "MTP layers: [%s] (num_nextn_predict_layers %d), %s parameters, not counted above\n",
        absl::StrJoin(mtp_layers, ", "), num_mtp_layers, Count(static_cast<double>(mtp_total)));
  }
  if (!layers.empty()) {
    std::vector<int64_t> dense;
    for (int64_t l : layers) {
      if (!moe_layers.count(l)) dense.push_back(l);
    }
    out << absl::StrFormat("MoE layout: %d layers, %d with routed experts", layers.size(),
                           moe_layers.size());
    if (!dense.empty()) out << ", dense MLP in layers [" << absl::StrJoin(dense, ", ") << "]";
    const bool per_expert = std::any_of(order.begin(), order.end(), [](const std::string& p) {
      return p.find(".experts.*.") != std::string::npos;
    });
    out << (per_expert ? "; experts stored one tensor per expert" : "; experts stored packed")
        << (std::any_of(
                order.begin(), order.end(),
                [](const std::string& p) { return p.find("shared_expert") != std::string::npos; })
                ? "; shared expert"
                : "")
        << "\n";
  }
  out << "tensors (layer and expert numbers folded into *):\n";
  for (const std::string& p : order) {
    const Group& g = groups[p];
    out << absl::StrFormat("  %-64s x%-6d %-5s %-18s %s\n", p, g.count,
                           absl::StrJoin(g.dtypes, ","),
                           g.shapes.size() == 1 ? *g.shapes.begin() : "(various)", Count(g.numel));
  }
  return absl::OkStatus();
}

}  // namespace moefit::launch
