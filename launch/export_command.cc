// The export command; see export_command.h.
#include "launch/export_command.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/training_manifest.h"
#include "checkpoint/weight_loader.h"
#include "framework/adapter_io.h"
#include "framework/hf_io.h"
#include "framework/training_checkpoint.h"
#include "launch/config.h"
#include "launch/run_setup.h"
#include "proto/status_macros.h"
#include "router/expert_placement.h"

namespace moefit::launch {

namespace {

// A training checkpoint: the model its recorded config describes, built at
// this world size with its trained tensors read by global expert index, saved
// as the run's final save would (the frozen base of a LoRA run comes from its
// model.model_path, as on resume).
absl::Status ExportTrainingCheckpoint(const std::string& src, const std::string& dst,
                                      const ExportCommandOptions& options,
                                      std::shared_ptr<parallel::Communicator> world,
                                      std::ostream& log) {
  MOEFIT_ASSIGN_OR_RETURN(proto::TrainingCheckpointManifest manifest,
                          checkpoint::ReadManifest(src));
  MOEFIT_ASSIGN_OR_RETURN(proto::Config config,
                          LoadConfigText(manifest.config_text(),
                                         src + "/" + checkpoint::kManifestName + " (config)", {}));
  MOEFIT_ASSIGN_OR_RETURN(RunConfig run, ResolveConfig(config));
  std::error_code ec;
  if (!run.model_path.empty() && std::filesystem::weakly_canonical(dst, ec) ==
                                     std::filesystem::weakly_canonical(run.model_path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("export: DST = '", dst, "' is the checkpoint's base model directory"));
  }
  run.runtime.expert_master_weights = true;  // as trained
  run.weights_from_checkpoint = !run.runtime.lora.enabled();
  run.resume_from = src;
  run.ep_size = 0;
  MOEFIT_ASSIGN_OR_RETURN(ParallelModel built, BuildModel(run, world, log));
  MOEFIT_ASSIGN_OR_RETURN(
      int64_t step,
      framework::LoadCheckpointWeights(*built.model, built.groups.expert_parallel->rank(), src));
  if (run.runtime.lora.enabled()) {
    framework::AdapterSaveOptions save;
    save.base_model_name_or_path = run.model_path;
    save.per_expert = run.lora_save_per_expert;
    MOEFIT_RETURN_IF_ERROR(framework::SaveAdapter(*built.model, dst, built.groups, save));
    log << "moefit: exported the LoRA adapter of " << src << " (step " << step << ") to " << dst
        << " (PEFT format)" << std::endl;
    return absl::OkStatus();
  }
  framework::SaveOptions save;
  save.max_shard_bytes = static_cast<uint64_t>(options.max_shard_bytes);
  save.dtype = options.dtype;
  save.base_config_json = run.base_config_json;
  save.copy_files_from = run.model_path;
  MOEFIT_RETURN_IF_ERROR(framework::SaveHfDirectory(*built.model, dst, built.groups, save));
  log << "moefit: exported the model of " << src << " (step " << step << ") to " << dst
      << " (Hugging Face format)" << std::endl;
  return absl::OkStatus();
}

}  // namespace

absl::Status RunExport(const std::string& src, const std::string& dst,
                       const ExportCommandOptions& options,
                       std::shared_ptr<parallel::Communicator> world, std::ostream& log_in) {
  std::ostringstream discard;
  std::ostream& log = world->rank() == 0 ? log_in : discard;
  if (std::filesystem::exists(std::filesystem::path(src) / checkpoint::kManifestName)) {
    return ExportTrainingCheckpoint(src, dst, options, std::move(world), log);
  }
  const std::filesystem::path config_path = std::filesystem::path(src) / "config.json";
  proto::Config config = DefaultConfig();
  config.mutable_model()->set_config_json(config_path.string());
  MOEFIT_RETURN_IF_ERROR(MergeHfConfigJson(config_path.string(), config.mutable_model()));
  MOEFIT_ASSIGN_OR_RETURN(RunConfig run, ResolveConfig(config));
  MOEFIT_ASSIGN_OR_RETURN(router::ExpertPlacement placement,
                          router::ExpertPlacement::Contiguous(run.model.num_experts, world->size()));

  checkpoint::LoadOptions lo;
  lo.first_expert = placement.first_expert(world->rank());
  lo.num_experts = placement.num_local(world->rank());
  // FP8 block-scaled weights are dequantized (to bfloat16 unless --save_dtype
  // says otherwise); multi-token-prediction layers are left out.
  framework::SetCheckpointFormat(run.model, lo);
  lo.dequantized_dtype = options.dtype.value_or(at::kBFloat16);
  checkpoint::LoadReport report;
  MOEFIT_ASSIGN_OR_RETURN(auto tensors,
                          checkpoint::LoadCheckpoint(src, run.model.model_type, lo, &report));
  std::stringstream config_text;
  config_text << std::ifstream(config_path).rdbuf();
  std::string config_json = config_text.str();
  nlohmann::json j = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_object()) {
    // What is written is never quantized: the config must not say it is.
    const bool was_quantized = j.contains("quantization_config");
    j.erase("quantization_config");
    // Nor does it hold the multi-token-prediction layers, which were skipped.
    if (run.model.num_nextn_predict_layers > 0) {
      j["num_nextn_predict_layers"] = 0;
      j.erase("num_mtp_layers");
    }
    if (options.dtype.has_value()) {
      j["torch_dtype"] = *options.dtype == at::kBFloat16 ? "bfloat16" : "float32";
    } else if (was_quantized) {
      j["torch_dtype"] = "bfloat16";
    }
    config_json = j.dump(2) + "\n";
  }

  framework::HfTensors in;
  in.family = run.model.model_type;
  in.tensors = std::move(tensors);
  in.first_expert = lo.first_expert;
  in.num_global_experts = run.model.num_experts;
  in.config_json_text = config_json;
  in.copy_files_from = src;
  framework::SaveOptions save;
  save.max_shard_bytes = static_cast<uint64_t>(options.max_shard_bytes);
  save.dtype = options.dtype;
  MOEFIT_RETURN_IF_ERROR(framework::SaveHfTensors(in, dst, *world, save));
  log << absl::StrFormat("moefit: exported %s (%s, %d experts) to %s; rank 0 read %.3f GB",
                         src, run.model.model_type, run.model.num_experts, dst,
                         report.num_bytes_read / 1e9)
      << std::endl;
  return absl::OkStatus();
}

}  // namespace moefit::launch
