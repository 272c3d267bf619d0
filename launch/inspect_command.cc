// The inspect command; see inspect_command.h.
#include "launch/inspect_command.h"

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

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/fp8.h"
#include "checkpoint/natural_order.h"
#include "checkpoint/safetensors.h"
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
bool IsExpertTensor(const std::string& name) {
  return name.find(".experts.") != std::string::npos;
}

// Tensors stored with the weights that transformers does not count as
// parameters: FP8 block scales (consumed by dequantization) and buffers.
bool IsScaleTensor(const std::string& name) {
  return absl::EndsWith(name, std::string(checkpoint::kScaleInvSuffix));
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
          << "), saved by " << m->layout().world_size() << " processes, "
          << m->layout().ep_size() << " expert-parallel ranks; " << m->files_size()
          << " files listed" << std::endl;
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

  std::map<std::string, Group> groups;
  std::vector<std::string> order;
  std::map<std::string, int64_t> numel_by_dtype;
  int64_t total = 0, expert_total = 0, num_tensors = 0;
  int64_t mtp_total = 0, scale_total = 0, num_scales = 0, buffer_total = 0, num_buffers = 0;
  uint64_t total_bytes = 0;
  std::set<int64_t> moe_layers, layers, mtp_layers;
  std::set<std::string> buffer_kinds;  // last name component, for the message
  static const std::regex kLayer("layers\\.([0-9]+)\\.");
  for (const fs::path& f : files) {
    MOEFIT_ASSIGN_OR_RETURN(checkpoint::SafetensorsFile file, checkpoint::SafetensorsFile::Open(f));
    for (const checkpoint::TensorInfo& t : file.tensors()) {
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
      if (in_layer && layer_idx >= mtp_from) {
        mtp_layers.insert(layer_idx);
        if (!IsScaleTensor(t.name) && !IsBufferTensor(t.name)) mtp_total += t.numel;
        continue;
      }
      if (IsScaleTensor(t.name)) {
        scale_total += t.numel;
        ++num_scales;
        continue;
      }
      if (IsBufferTensor(t.name)) {
        buffer_total += t.numel;
        ++num_buffers;
        buffer_kinds.insert(t.name.substr(t.name.rfind('.') + 1));
        continue;
      }
      numel_by_dtype[std::string(checkpoint::DtypeName(t.dtype))] += t.numel;
      total += t.numel;
      if (in_layer) {
        layers.insert(layer_idx);
        if (IsExpertTensor(t.name)) moe_layers.insert(layer_idx);
      }
      if (IsExpertTensor(t.name)) expert_total += t.numel;
    }
  }
  std::sort(order.begin(), order.end(), checkpoint::NaturalLess);

  out << absl::StrFormat("%s: %d tensors in %d file%s, %s\n", path, num_tensors, files.size(),
                         files.size() == 1 ? "" : "s", Bytes(static_cast<double>(total_bytes)));
  int64_t num_experts = 0, top_k = 0;
  if (!config.is_null()) {
    for (const char* key : {"num_experts", "num_local_experts", "n_routed_experts"}) {
      if (config.contains(key) && config[key].is_number_integer()) num_experts = config[key];
    }
    if (config.contains("num_experts_per_tok") && config["num_experts_per_tok"].is_number_integer()) {
      top_k = config["num_experts_per_tok"];
    }
    out << absl::StrFormat("config.json: model_type %s, %s layers, hidden %s, %d experts, top-%d\n",
                           config.value("model_type", std::string("?")),
                           config.contains("num_hidden_layers") ? config["num_hidden_layers"].dump() : "?",
                           config.contains("hidden_size") ? config["hidden_size"].dump() : "?",
                           num_experts, top_k);
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
  if (num_scales > 0 || num_buffers > 0) {
    std::vector<std::string> parts;
    if (num_scales > 0) {
      parts.push_back(absl::StrCat(Count(static_cast<double>(scale_total)), " in ", num_scales,
                                   " FP8 block scales (*_scale_inv)"));
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
        << (std::any_of(order.begin(), order.end(),
                        [](const std::string& p) { return p.find("shared_expert") != std::string::npos; })
                ? "; shared expert"
                : "")
        << "\n";
  }
  out << "tensors (layer and expert numbers folded into *):\n";
  for (const std::string& p : order) {
    const Group& g = groups[p];
    out << absl::StrFormat("  %-64s x%-6d %-5s %-18s %s\n", p, g.count, absl::StrJoin(g.dtypes, ","),
                           g.shapes.size() == 1 ? *g.shapes.begin() : "(various)", Count(g.numel));
  }
  return absl::OkStatus();
}

}  // namespace moefit::launch
