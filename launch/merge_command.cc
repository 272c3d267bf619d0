// The merge command; see merge_command.h.
#include "launch/merge_command.h"

#include <ATen/ATen.h>

#include <sstream>

#include "framework/hf_io.h"
#include "launch/config.h"
#include "launch/run_setup.h"
#include "proto/status_macros.h"

namespace moefit::launch {

absl::Status RunMerge(const std::string& base, const std::string& adapter, const std::string& out,
                      const MergeCommandOptions& options,
                      std::shared_ptr<parallel::Communicator> world, std::ostream& log_in) {
  std::ostringstream discard;
  std::ostream& log = world->rank() == 0 ? log_in : discard;
  // The base and the adapter say everything: a default config pointed at them.
  MOEFIT_ASSIGN_OR_RETURN(
      proto::Config config,
      LoadConfigText("", "<merge>", {"model.model_path=" + base, "lora.adapter_path=" + adapter}));
  MOEFIT_ASSIGN_OR_RETURN(RunConfig run, ResolveConfig(config));
  MOEFIT_ASSIGN_OR_RETURN(at::ScalarType base_dtype, framework::CheckpointBaseDtype(base));
  // The fold is rounded once, to the written dtype: a float32 save merges into
  // a float32 copy of the base.
  run.lora_base_dtype = options.dtype.value_or(base_dtype) == at::kFloat ? at::kFloat : base_dtype;
  MOEFIT_ASSIGN_OR_RETURN(ParallelModel built, BuildModel(run, world, log));
  MOEFIT_RETURN_IF_ERROR(built.model->MergeAdapters());
  framework::SaveOptions save;
  save.max_shard_bytes = static_cast<uint64_t>(options.max_shard_bytes);
  save.dtype = options.dtype.value_or(base_dtype);
  save.base_config_json = run.base_config_json;
  save.copy_files_from = base;
  MOEFIT_RETURN_IF_ERROR(framework::SaveHfDirectory(*built.model, out, built.groups, save));
  log << "moefit: merged " << adapter << " into " << base << " and wrote " << out
      << " (Hugging Face format, " << c10::toString(*save.dtype) << ")" << std::endl;
  return absl::OkStatus();
}

}  // namespace moefit::launch
