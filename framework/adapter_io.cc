// PEFT adapter directories; see adapter_io.h.
#include "framework/adapter_io.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_io.h"
#include "framework/lora.h"
#include "framework/output_dir.h"
#include "proto/status_macros.h"

namespace moefit::framework {
namespace {

namespace fs = std::filesystem;

constexpr char kConfigFile[] = "adapter_config.json";
constexpr char kWeightsFile[] = "adapter_model.safetensors";
constexpr char kPrefix[] = "base_model.model.";

// One adapter tensor as stored: its PEFT name and, for the routed experts,
// how the local [E_local, ...] tensor maps onto the fused one.
struct StoredName {
  std::string key;
  enum Kind { kDense, kExpertA, kExpertB } kind = kDense;
};

// "model.layers.3.mlp.experts.gate_up_proj.lora_A" -> its PEFT key.
StoredName PeftName(const Parameter& p, const LoraTargets& targets) {
  if (!p.expert) return {kPrefix + p.name, StoredName::kDense};
  const size_t proj = p.name.rfind(".experts.") + std::string(".experts.").size();
  const std::string module = p.name.substr(0, proj - 1);  // ...mlp.experts
  const bool gate_up = p.name.compare(proj, 12, "gate_up_proj") == 0;
  const bool a = p.name.ends_with(".lora_A");
  // PEFT nests the wrappers in parameter order: gate_up_proj's is the inner one.
  const std::string nest = gate_up && targets.expert_down ? "base_layer." : "";
  return {absl::StrCat(kPrefix, module, ".", nest, a ? "lora_A.weight" : "lora_B.weight"),
          a ? StoredName::kExpertA : StoredName::kExpertB};
}

// Local expert adapters [E_local, ...] gathered over the expert-parallel group
// into [E, ...] (contiguous placement: ranks hold consecutive experts).
at::Tensor GatherExperts(const at::Tensor& local, const MoeModel& model,
                         parallel::Communicator& ep) {
  std::vector<int64_t> counts;  // rows (experts) per rank
  for (int r = 0; r < ep.size(); ++r) counts.push_back(model.placement().num_local(r));
  std::vector<int64_t> shape = local.sizes().vec();
  shape[0] = model.options().num_experts;
  at::Tensor all = at::empty(shape, local.options());
  ep.AllGatherV(local.detach().contiguous(), all, counts)->WaitOrThrow();
  return all;
}

// [E, r, in] -> PEFT's [E·r, in]; [E, out, r] -> PEFT's [out, r·E] (column j·E + e).
at::Tensor FuseA(const at::Tensor& a) { return a.reshape({-1, a.size(2)}); }
at::Tensor FuseB(const at::Tensor& b) {
  return b.permute({1, 2, 0}).reshape({b.size(1), -1}).contiguous();
}
// The inverses, for experts [first, first + num).
at::Tensor SplitA(const at::Tensor& fused, int64_t num_experts, int64_t first, int64_t num) {
  return fused.view({num_experts, -1, fused.size(1)}).narrow(0, first, num);
}
at::Tensor SplitB(const at::Tensor& fused, int64_t num_experts, int64_t first, int64_t num) {
  return fused.view({fused.size(0), -1, num_experts}).permute({2, 0, 1}).narrow(0, first, num);
}

// adapter_config.json's target lists for the model's targets. Each targeted
// role (the module name without "model.layers.N.") is named once when every
// module of that role is targeted, else each module by its full name. With
// transformers v5, PEFT rewrites target_modules entries ending in gate_proj,
// up_proj or down_proj into the fused experts' parameters; dense MLPs and
// shared experts are therefore named as target_parameters ("mlp.gate_proj.weight"),
// which PEFT adapts with the same lora_A/lora_B keys.
std::pair<std::vector<std::string>, std::vector<std::string>> TargetLists(
    const ModelOptions& o, const LoraTargets& targets) {
  auto role = [](const std::string& name) {
    if (!name.starts_with("model.layers.")) return name;
    return name.substr(name.find('.', std::string("model.layers.").size()) + 1);
  };
  std::map<std::string, std::vector<std::string>> by_role, targeted_by_role;
  for (const LinearModule& m : LinearModules(o)) {
    by_role[role(m.name)].push_back(m.name);
    if (targets.modules.contains(m.name)) targeted_by_role[role(m.name)].push_back(m.name);
  }
  std::vector<std::string> modules, parameters;
  for (const auto& [r, names] : targeted_by_role) {
    const std::vector<std::string> entries =
        names.size() == by_role[r].size() ? std::vector<std::string>{r} : names;
    const bool mlp = r.ends_with("gate_proj") || r.ends_with("up_proj") || r.ends_with("down_proj");
    for (const std::string& e : entries) {
      if (mlp) {
        parameters.push_back(e + ".weight");
      } else {
        modules.push_back(e);
      }
    }
  }
  if (targets.expert_gate_up) parameters.push_back("mlp.experts.gate_up_proj");
  if (targets.expert_down) parameters.push_back("mlp.experts.down_proj");
  return {modules, parameters};
}

nlohmann::json ConfigJson(const LoraOptions& lora, const std::vector<std::string>& modules,
                          const std::vector<std::string>& parameters,
                          const std::string& base_model) {
  nlohmann::json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = base_model;
  j["r"] = lora.rank;
  j["lora_alpha"] = lora.alpha;
  // PEFT refuses dropout on target_parameters; it only matters in training.
  j["lora_dropout"] = parameters.empty() ? lora.dropout : 0.0;
  j["use_rslora"] = lora.use_rslora;
  j["target_modules"] = modules.empty() ? nlohmann::json(nullptr) : nlohmann::json(modules);
  j["target_parameters"] =
      parameters.empty() ? nlohmann::json(nullptr) : nlohmann::json(parameters);
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["modules_to_save"] = nullptr;
  j["use_dora"] = false;
  j["lora_bias"] = false;
  j["rank_pattern"] = nlohmann::json::object();
  j["alpha_pattern"] = nlohmann::json::object();
  j["layers_to_transform"] = nullptr;
  j["layers_pattern"] = nullptr;
  return j;
}

// Writes one adapter directory's two files into `dir`.
absl::Status WriteAdapterFiles(const fs::path& dir, const nlohmann::json& config,
                               const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  MOEFIT_RETURN_IF_ERROR(checkpoint::SaveTensors(dir / kWeightsFile, tensors));
  return WriteTextFile(dir / kConfigFile, config.dump(2) + "\n");
}

}  // namespace

absl::StatusOr<AdapterConfig> ReadAdapterConfig(const std::string& dir) {
  const fs::path path = fs::path(dir) / kConfigFile;
  std::ifstream in(path);
  if (!in)
    return absl::NotFoundError(
        absl::StrCat(path.string(), ": cannot open (not a PEFT adapter directory?)"));
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object())
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": not a JSON object"));
  auto bad = [&](const std::string& field, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": ", field, " ", why));
  };
  auto is_set = [&](const char* key) {
    return j.contains(key) && !j[key].is_null() && !(j[key].is_object() && j[key].empty()) &&
           !(j[key].is_array() && j[key].empty()) && !(j[key].is_boolean() && !j[key].get<bool>());
  };
  if (j.contains("peft_type") && j["peft_type"] != "LORA") {
    return bad("peft_type",
               absl::StrCat("= ", j["peft_type"].dump(), ": only LORA adapters are read"));
  }
  // Read, or with no effect on the weights; every other key must be unset
  // (null, false, empty), so that a setting moefit does not implement (DoRA,
  // patterns, excluded modules, aLoRA, ...) is never applied silently.
  static const std::set<std::string> kKnown = {"peft_type",
                                               "task_type",
                                               "base_model_name_or_path",
                                               "revision",
                                               "r",
                                               "lora_alpha",
                                               "lora_dropout",
                                               "use_rslora",
                                               "target_modules",
                                               "target_parameters",
                                               "bias",
                                               "inference_mode",
                                               "init_lora_weights",
                                               "peft_version",
                                               "auto_mapping",
                                               "layers_pattern",
                                               "megatron_core",
                                               "qalora_group_size",
                                               "ensure_weight_tying"};
  for (const auto& [key, value] : j.items()) {
    if (!kKnown.contains(key) && is_set(key.c_str())) {
      return bad(key, absl::StrCat("= ", value.dump(), " is not supported by moefit"));
    }
  }
  if (j.contains("bias") && j["bias"] != "none") {
    return bad("bias", absl::StrCat("= ", j["bias"].dump(), " is not supported (only \"none\")"));
  }
  AdapterConfig c;
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int64_t>() <= 0) {
    return bad("r", "must be a positive integer");
  }
  c.r = j["r"].get<int64_t>();
  if (!j.contains("lora_alpha") || !j["lora_alpha"].is_number())
    return bad("lora_alpha", "must be a number");
  c.lora_alpha = j["lora_alpha"].get<double>();
  if (j.contains("lora_dropout") && j["lora_dropout"].is_number()) {
    c.lora_dropout = j["lora_dropout"].get<double>();
  }
  if (j.contains("use_rslora") && j["use_rslora"].is_boolean()) c.use_rslora = j["use_rslora"];
  auto names = [&](const char* key, std::vector<std::string>* out) -> absl::Status {
    if (!j.contains(key) || j[key].is_null()) return absl::OkStatus();
    if (j[key].is_string()) {
      return bad(key, "is a regular expression; moefit reads only a list of module names");
    }
    if (!j[key].is_array()) return bad(key, "must be a list of names");
    for (const auto& v : j[key]) {
      if (!v.is_string()) return bad(key, "must be a list of names");
      out->push_back(v.get<std::string>());
    }
    return absl::OkStatus();
  };
  MOEFIT_RETURN_IF_ERROR(names("target_modules", &c.target_modules));
  MOEFIT_RETURN_IF_ERROR(names("target_parameters", &c.target_parameters));
  for (const std::string& m : c.target_modules) {
    const std::string last = m.substr(m.rfind('.') + 1);
    if (last == "gate_proj" || last == "up_proj" || last == "down_proj") {
      return bad(
          "target_modules",
          absl::StrCat(
              "names '", m,
              "', which PEFT maps onto the fused experts (gate_up_proj with twice the "
              "rank); moefit reads the experts as target_parameters mlp.experts.gate_up_proj and "
              "mlp.experts.down_proj, and dense MLPs as target_parameters '",
              m, ".weight'"));
    }
  }
  if (c.target_modules.empty() && c.target_parameters.empty()) {
    return bad("target_modules", "and target_parameters are both empty");
  }
  if (j.contains("base_model_name_or_path") && j["base_model_name_or_path"].is_string()) {
    c.base_model_name_or_path = j["base_model_name_or_path"];
  }
  return c;
}

absl::Status SaveAdapter(const MoeModel& model, const std::string& dir_in,
                         const parallel::ProcessGroups& groups, const AdapterSaveOptions& options) {
  parallel::Communicator& world = *groups.world;
  const bool rank0 = world.rank() == 0;
  const fs::path dir = fs::path(dir_in).lexically_normal();
  const LoraTargets& targets = model.lora_targets();
  const ModelOptions& o = model.options();
  if (model.adapters().empty()) {
    return absl::FailedPreconditionError("the model has no LoRA adapters to save");
  }
  // Whole tensors, PEFT's layout, on the CPU (gathered on every expert group).
  std::vector<std::pair<std::string, at::Tensor>> fused;
  std::map<std::string, at::Tensor> whole;  // moefit name -> [E, ...] or dense
  for (const Parameter& p : model.adapters()) {
    // Gathered one tensor at a time; only rank 0, which writes, keeps them.
    at::Tensor t = p.expert ? GatherExperts(p.tensor, model, *groups.expert_parallel)
                            : p.tensor.detach().to(at::kCPU);
    if (!rank0) continue;
    if (options.per_expert) whole[p.name] = t;
    const StoredName n = PeftName(p, targets);
    fused.emplace_back(n.key, n.kind == StoredName::kExpertA   ? FuseA(t)
                              : n.kind == StoredName::kExpertB ? FuseB(t)
                                                               : t);
  }
  const auto [modules, parameters] = TargetLists(o, targets);

  absl::Status status = absl::OkStatus();
  fs::path partial;
  if (rank0) {
    status = StageDirectory(dir, &partial);
    if (status.ok()) {
      status = WriteAdapterFiles(
          partial,
          ConfigJson(model.runtime().lora, modules, parameters, options.base_model_name_or_path),
          fused);
    }
    if (status.ok() && options.per_expert) {
      // One module per routed expert: gate and up share the fused adapter's A.
      std::vector<std::pair<std::string, at::Tensor>> split;
      for (const Parameter& p : model.adapters()) {
        if (!p.expert) split.emplace_back(kPrefix + p.name, whole[p.name]);
      }
      const int64_t inter = o.moe_intermediate_size;
      for (int64_t l = 0; l < o.num_hidden_layers; ++l) {
        if (!o.IsMoeLayer(l)) continue;
        const std::string m = absl::StrCat("model.layers.", l, ".mlp.experts.");
        for (int64_t e = 0; e < o.num_experts; ++e) {
          const std::string k = absl::StrCat(kPrefix, m, e, ".");
          if (targets.expert_gate_up) {
            const at::Tensor a = whole[m + "gate_up_proj.lora_A"][e];
            const at::Tensor b = whole[m + "gate_up_proj.lora_B"][e];
            split.emplace_back(k + "gate_proj.lora_A.weight", a);
            split.emplace_back(k + "gate_proj.lora_B.weight", b.narrow(0, 0, inter));
            split.emplace_back(k + "up_proj.lora_A.weight", a);
            split.emplace_back(k + "up_proj.lora_B.weight", b.narrow(0, inter, inter));
          }
          if (targets.expert_down) {
            split.emplace_back(k + "down_proj.lora_A.weight", whole[m + "down_proj.lora_A"][e]);
            split.emplace_back(k + "down_proj.lora_B.weight", whole[m + "down_proj.lora_B"][e]);
          }
        }
      }
      std::vector<std::string> per_expert_modules = modules;
      for (const std::string& p : parameters) {
        if (p.ends_with(".weight")) per_expert_modules.push_back(p.substr(0, p.size() - 7));
      }
      if (targets.expert_gate_up) {
        per_expert_modules.push_back("gate_proj");
        per_expert_modules.push_back("up_proj");
      }
      if (targets.expert_down) per_expert_modules.push_back("down_proj");
      std::error_code ec;
      fs::create_directories(partial / "per_expert", ec);
      status = ec ? absl::InternalError(absl::StrCat(
                        "cannot create ", (partial / "per_expert").string(), ": ", ec.message()))
                  : WriteAdapterFiles(partial / "per_expert",
                                      ConfigJson(model.runtime().lora, per_expert_modules, {},
                                                 options.base_model_name_or_path),
                                      split);
    }
    if (status.ok()) status = PublishDirectory(partial, dir);
  }
  if (AnyRankFailed(world, !status.ok())) {
    return status.ok() ? absl::InternalError("rank 0 could not write the adapter") : status;
  }
  return absl::OkStatus();
}

absl::Status LoadAdapter(MoeModel& model, const std::string& dir) {
  const fs::path path = fs::path(dir) / kWeightsFile;
  MOEFIT_ASSIGN_OR_RETURN(checkpoint::SafetensorsFile file,
                          checkpoint::SafetensorsFile::Open(path));
  const LoraTargets& targets = model.lora_targets();
  const int64_t num_experts = model.options().num_experts;
  const int64_t first = model.placement().first_expert(model.runtime().expert_group->rank());
  std::set<std::string> unused;
  for (const std::string& name : file.TensorNames()) unused.insert(name);
  torch::NoGradGuard no_grad;
  for (const Parameter& p : model.adapters()) {
    const StoredName n = PeftName(p, targets);
    absl::StatusOr<at::Tensor> t = checkpoint::ReadTensor(file, n.key, {.dtype = at::kFloat});
    if (!t.ok()) {
      return absl::NotFoundError(absl::StrCat(path.string(), ": no tensor ", n.key, " for ", p.name,
                                              " (", t.status().message(), ")"));
    }
    unused.erase(n.key);
    std::vector<int64_t> want = p.tensor.sizes().vec();
    if (p.expert) {
      want[0] = num_experts;
      want = n.kind == StoredName::kExpertA ? std::vector<int64_t>{want[0] * want[1], want[2]}
                                            : std::vector<int64_t>{want[1], want[2] * want[0]};
    }
    if (t->sizes().vec() != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          path.string(), ": ", n.key, " has shape ", c10::str(t->sizes()), ", expected ",
          c10::str(at::IntArrayRef(want)), " (rank ", model.runtime().lora.rank, ")"));
    }
    const int64_t local = p.expert ? p.tensor.size(0) : 0;
    at::Tensor src = n.kind == StoredName::kExpertA   ? SplitA(*t, num_experts, first, local)
                     : n.kind == StoredName::kExpertB ? SplitB(*t, num_experts, first, local)
                                                      : *t;
    p.tensor.copy_(src);
  }
  if (!unused.empty()) {
    std::vector<std::string> some(unused.begin(), unused.end());
    if (some.size() > 5) some.resize(5);
    return absl::InvalidArgumentError(absl::StrCat(
        path.string(), ": ", unused.size(), " tensors match no adapter of this model: ",
        absl::StrJoin(some, ", "), unused.size() > 5 ? ", ..." : ""));
  }
  return absl::OkStatus();
}

}  // namespace moefit::framework
