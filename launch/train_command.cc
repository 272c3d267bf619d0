// The train command; see train_command.h.
#include "launch/train_command.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <filesystem>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/training_manifest.h"
#include "experts/kernels/isa.h"
#include "framework/adapter_io.h"
#include "framework/data.h"
#include "framework/hf_io.h"
#include "framework/model.h"
#include "framework/trainer.h"
#include "framework/training_checkpoint.h"
#include "launch/memory_report.h"
#include "launch/run_setup.h"
#include "parallel/process_groups.h"
#ifdef MOEFIT_HAS_NCCL
#include "parallel/nccl_communicator.h"
#endif
#include "proto/status_macros.h"

namespace moefit::launch {
using framework::DtypeName;

absl::Status RunTraining(const RunConfig& run, std::shared_ptr<parallel::Communicator> world,
                         std::ostream& log_in) {
  std::ostringstream discard;
  std::ostream& log = world->rank() == 0 ? log_in : discard;
  if (run.lora_adapter_only) {
    return absl::InvalidArgumentError(
        "lora.adapter_path applies an adapter without training it (moefit eval, merge); to "
        "continue training an adapter use lora.init_from");
  }
  // The save replaces its directory: never the model or adapter being read.
  for (const std::string& input : {run.model_path, run.lora_init_from}) {
    std::error_code ec;
    if (!run.save_dir.empty() && !input.empty() &&
        std::filesystem::weakly_canonical(run.save_dir, ec) ==
            std::filesystem::weakly_canonical(input, ec)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint.save_dir = '", run.save_dir, "' is the directory the run reads (", input,
          "): the save would replace it; choose another directory"));
    }
  }
  absl::StatusOr<framework::TokenDataset> data = LoadDataset(run);
  if (!data.ok()) return data.status();
  // Trained bfloat16 experts keep float32 masters (the model ignores it
  // otherwise: float32 or frozen experts).
  RunConfig train_run = run;
  train_run.runtime.expert_master_weights = true;
  // A resumed run takes its trainable tensors from the checkpoint: in full
  // mode every weight (nothing is drawn or loaded first); under LoRA the
  // adapters, on the base of model.model_path.
  std::filesystem::path resume_dir;
  if (!run.resume_from.empty()) {
    MOEFIT_ASSIGN_OR_RETURN(resume_dir, framework::ResolveResumeDir(run.resume_from, run.save_dir));
    // A missing or unreadable manifest stops the run before the model is built.
    MOEFIT_RETURN_IF_ERROR(checkpoint::ReadManifest(resume_dir).status());
    train_run.weights_from_checkpoint = !run.runtime.lora.enabled();
  }
  MOEFIT_ASSIGN_OR_RETURN(ParallelModel built, BuildModel(train_run, world, log));
  const parallel::ProcessGroups& groups = built.groups;
  std::unique_ptr<framework::MoeModel>& model = built.model;
  const framework::ModelOptions& m = run.model;
  if (run.train.optimizer.stochastic_rounding && !model->runtime().expert_master_weights) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer.stochastic_rounding rounds the bfloat16 copies of float32 expert masters, "
        "which this run does not have (experts in ",
        DtypeName(model->runtime().expert_dtype), ", train.mode ",
        run.runtime.lora.enabled() ? "lora" : "full",
        "): set experts.dtype=bfloat16 with train.mode=full, or drop it"));
  }
  // Parameters of the whole model (this rank holds only its experts), as
  // transformers counts them.
  const framework::ParameterCounts counts = framework::CountParameters(m);
  const int64_t local = model->placement().num_local(groups.expert_parallel->rank());
  log << absl::StrFormat(
             "moefit: %s, %d layers, hidden %d, %d experts (top-%d), %d parameters "
             "(%d active); dense on %s, experts on cpu (%s, %s%s); %d sequences of %d tokens",
             m.model_type, m.num_hidden_layers, m.hidden_size, m.num_experts, m.num_experts_per_tok,
             counts.total, counts.active, run.runtime.dense_device.str(),
             run.runtime.expert_backend, DtypeName(model->runtime().expert_dtype),
             model->runtime().expert_master_weights ? " with float32 master weights" : "",
             data->num_sequences(), run.seq_len)
      << std::endl;
  if (run.runtime.expert_backend == "grouped") {
    log << "moefit: expert kernels "
        << experts::kernels::IsaDescription(experts::kernels::ActiveIsa())
        << " (CPU flags: " << experts::kernels::CpuFlags() << ")" << std::endl;
  }
  if (run.runtime.lora.enabled()) {
    // As PEFT's print_trainable_parameters: the adapters of every expert.
    const int64_t lora =
        framework::CountLoraParameters(m, model->lora_targets(), run.runtime.lora.rank);
    log << absl::StrFormat(
               "moefit: LoRA rank %d, alpha %g on [%s]: trainable params: %d || all params: %d "
               "|| trainable%%: %.4f; frozen base in %s (dense) and %s (experts)",
               run.runtime.lora.rank, run.runtime.lora.alpha,
               absl::StrJoin(run.runtime.lora.target_modules, ", "), lora, counts.total + lora,
               100.0 * static_cast<double>(lora) / static_cast<double>(counts.total + lora),
               DtypeName(model->runtime().dense_dtype), DtypeName(model->runtime().expert_dtype))
        << std::endl;
  }
  if (world->size() > 1) {
    log << absl::StrFormat(
               "moefit: %d ranks, expert-parallel groups of %d (%d experts each), %s dispatch%s%s",
               world->size(), groups.ep_size, local, run.runtime.dispatcher,
               run.runtime.dispatch_chunks > 1
                   ? absl::StrFormat(" pipelined over %d token chunks", run.runtime.dispatch_chunks)
                   : "",
               run.progress_thread_us > 0
                   ? absl::StrFormat(", MPI progress thread every %d us", run.progress_thread_us)
                   : "")
        << std::endl;
  }
  if (world->rank() == 0 && !run.train.metrics_file.empty() && resume_dir.empty()) {
    // A new run starts a new metrics file (a resumed one appends).
    if (std::FILE* f = std::fopen(run.train.metrics_file.c_str(), "w")) {
      std::fclose(f);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("logging.metrics_file: cannot open '",
                                                     run.train.metrics_file, "' for writing"));
    }
  }
#ifdef MOEFIT_HAS_NCCL
  if (built.gpu_per_process && groups.data_parallel->size() > 1) {
    // Dense gradients stay on the GPUs: NCCL over the data-parallel ranks.
    MOEFIT_ASSIGN_OR_RETURN(
        built.groups.dense_gradients,
        parallel::NcclCommunicator::Create(
            groups.data_parallel,
            {.name = "dense", .device_idx = model->runtime().dense_device.index()}));
  }
#endif
  log << "moefit: dense gradients summed over "
      << (groups.dense_gradients != nullptr ? groups.dense_gradients : groups.data_parallel)
             ->BackendName()
      << (run.train.overlap_grad_sync ? ", bucket by bucket during backward" : ", after backward")
      << std::endl;
  framework::Trainer trainer(*model, *data, run.train, &groups);
  if (!resume_dir.empty()) {
    MOEFIT_ASSIGN_OR_RETURN(
        int64_t step, framework::LoadTrainingCheckpoint(trainer, resume_dir, &run.model_config));
    log << "moefit: resumed from " << resume_dir.string() << " after step " << step << std::endl;
  }
  // With training checkpoints the end-of-training model goes to
  // save_dir/final, beside the step-* directories.
  std::string final_dir = run.save_dir;
  std::unique_ptr<framework::Checkpointer> checkpointer;
  if (run.training_checkpoints()) {
    final_dir = (std::filesystem::path(run.save_dir) / "final").string();
    framework::CheckpointingOptions ck;
    ck.save_dir = run.save_dir;
    ck.save_every_steps = run.save_every_steps;
    ck.save_every_minutes = run.save_every_minutes;
    ck.keep_last = run.keep_last;
    ck.config_text = run.config_text;
    ck.model_config = run.model_config;
    checkpointer = std::make_unique<framework::Checkpointer>(trainer, std::move(ck), log);
    framework::InstallStopSignalHandlers();
  }
  MOEFIT_ASSIGN_OR_RETURN(
      std::vector<framework::StepStats> stats,
      trainer.Run(log, {}, checkpointer ? checkpointer->Hook() : framework::StepEndHook()));
  if (checkpointer && checkpointer->stopped()) {
    log << "moefit: resume with --set checkpoint.resume_from=latest" << std::endl;
    return absl::OkStatus();
  }
  if (!stats.empty()) {
    log << absl::StrFormat("done: loss %.4f -> %.4f over %d steps", stats.front().loss,
                           stats.back().loss, stats.size());
    if (!run.train.metrics_file.empty()) log << "; metrics in " << run.train.metrics_file;
    log << std::endl;
  }
  // What this run held at its peak, and what its experts hold per parameter.
  LogEndMemory(*model, *groups.world, log);
  if (!final_dir.empty() && run.runtime.lora.enabled()) {
    framework::AdapterSaveOptions save;
    save.base_model_name_or_path = run.model_path;
    save.per_expert = run.lora_save_per_expert;
    MOEFIT_RETURN_IF_ERROR(framework::SaveAdapter(*model, final_dir, groups, save));
    log << "moefit: saved the LoRA adapter to " << final_dir << " (PEFT format)" << std::endl;
  } else if (!final_dir.empty()) {
    framework::SaveOptions save;
    save.max_shard_bytes = static_cast<uint64_t>(run.max_shard_bytes);
    save.dtype = run.save_dtype;
    save.base_config_json = run.base_config_json;
    save.copy_files_from = run.model_path;
    MOEFIT_RETURN_IF_ERROR(framework::SaveHfDirectory(*model, final_dir, groups, save));
    log << "moefit: saved the model to " << final_dir << " (Hugging Face format)" << std::endl;
  }
  return absl::OkStatus();
}

}  // namespace moefit::launch
