// LoRA adapters on disk, in PEFT's format: a directory with
// adapter_config.json and adapter_model.safetensors that
// `PeftModel.from_pretrained(transformers_model, DIR)` loads.
//
// Names are PEFT's: "base_model.model." + module + ".lora_A.weight" [r, in]
// and ".lora_B.weight" [out, r] for dense modules. The routed experts are
// parameters of transformers' fused experts module, adapted through
// target_parameters: lora_A.weight [E·r, in] (expert e's A in rows
// [e·r, (e+1)·r)) and lora_B.weight [out, r·E] (expert e's B in columns
// e, E + e, 2E + e, ...). When both gate_up_proj and down_proj are adapted,
// PEFT nests the two wrappers in parameter order: gate_up_proj's adapter is
// under "mlp.experts.base_layer.", down_proj's under "mlp.experts."; alone,
// either is under "mlp.experts.".
//
// Writing is collective: each rank holds its own experts' adapters; they are
// gathered tensor by tensor over the expert-parallel group and world rank 0
// writes the directory (under DIR.partial, renamed into place when complete).
// Reading is per rank: each rank reads the dense adapters and its experts'
// rows and columns.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "framework/model.h"
#include "parallel/process_groups.h"

namespace moefit::framework {

// The fields of adapter_config.json moefit reads and writes.
struct AdapterConfig {
  int64_t r = 0;
  double lora_alpha = 0;
  double lora_dropout = 0;
  bool use_rslora = false;
  std::vector<std::string> target_modules;
  std::vector<std::string> target_parameters;
  std::string base_model_name_or_path;
};

// Reads DIR/adapter_config.json. Errors name the file and the field: a
// peft_type other than LORA, and every setting moefit does not implement
// (DoRA, LoRA biases, per-module rank or alpha patterns, fan_in_fan_out,
// layers_to_transform, modules_to_save, ...).
absl::StatusOr<AdapterConfig> ReadAdapterConfig(const std::string& dir);

struct AdapterSaveOptions {
  std::string base_model_name_or_path;  // the base model directory, for adapter_config.json
  // Also write per_expert/: the same adapter with one module per routed expert
  // (model.layers.L.mlp.experts.J.{gate,up,down}_proj), as serving engines
  // that load per-expert LoRA expect.
  bool per_expert = false;
};

// Collective over groups.world: writes the model's adapters (MoeModel::adapters)
// to `dir` as a PEFT adapter directory.
absl::Status SaveAdapter(const MoeModel& model, const std::string& dir,
                         const parallel::ProcessGroups& groups, const AdapterSaveOptions& options);

// Loads the adapter of `dir` into the model's adapters (whose rank and targets
// must be the adapter's: the model is built from its adapter_config.json).
// Missing, unexpected or mis-shaped tensors fail with one message naming them.
absl::Status LoadAdapter(MoeModel& model, const std::string& dir);

}  // namespace moefit::framework
