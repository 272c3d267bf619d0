// The train command; see train_command.h.
#include "launch/train_command.h"

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include <cstdio>
#include <filesystem>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/training_manifest.h"
#include "checkpoint/weight_loader.h"
#include "experts/kernels/isa.h"
#include "framework/adapter_io.h"
#include "framework/data.h"
#include "framework/hf_io.h"
#include "framework/model.h"
#include "framework/trainer.h"
#include "framework/training_checkpoint.h"
#include "launch/corpus.h"
#include "launch/memory_report.h"
#include "parallel/process_groups.h"
#ifdef MOEFIT_HAS_NCCL
#include "parallel/nccl_communicator.h"
#endif
#include "proto/status_macros.h"

namespace moefit::launch {
using framework::DtypeName;

absl::StatusOr<ParallelModel> BuildModel(const RunConfig& run_in,
                                         std::shared_ptr<parallel::Communicator> world,
                                         std::ostream& log) {
  RunConfig run = run_in;
  ParallelModel out;
  absl::StatusOr<parallel::ProcessGroups> groups =
      parallel::MakeProcessGroups(std::move(world), {.ep_size = run.ep_size});
  if (!groups.ok()) {
    return absl::Status(groups.status().code(),
                        absl::StrCat("parallel.ep_size: ", groups.status().message()));
  }
  out.groups = std::move(*groups);
  run.runtime.expert_group = out.groups.expert_parallel;
  if (run.runtime.dense_device.is_cuda()) {
    // One GPU per process of the node (or shared, as parallel.ranks_per_gpu allows).
    MOEFIT_ASSIGN_OR_RETURN(const parallel::NodeRank node,
                            parallel::FindNodeRank(*out.groups.world));
    const int num_gpus = static_cast<int>(torch::cuda::device_count());
    MOEFIT_ASSIGN_OR_RETURN(const int gpu_idx,
                            parallel::ChooseGpu(node, num_gpus, {run.ranks_per_gpu}));
    run.runtime.dense_device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(gpu_idx));
    // LibTorch's current device too, so that nothing lands on GPU 0 by default.
    c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(run.runtime.dense_device);
    out.gpu_per_process = parallel::GpuPerProcess(node, num_gpus);
    // The hot-expert cache computes on this process's GPU.
    if (run.train.gpu_cache_experts > 0) run.runtime.expert_cache_device = run.runtime.dense_device;
  }
  if (run.runtime.recompute == framework::Recompute::kFull && !run.runtime.dense_device.is_cpu() &&
      out.groups.world->size() > 1) {
    // Its recomputation would run the layer's collectives on the GPU's autograd
    // thread, and MPI is started for the main thread only.
    return absl::InvalidArgumentError(
        "train.recompute = 'full' with the dense layers on a GPU runs in one process only; use "
        "train.recompute = 'experts' under mpirun");
  }
  // A compressed-tensors int4 checkpoint's experts are laid out in memory as
  // it stores them: its group size, and zero points where it has them.
  if (run.model.int4_weights) {
    run.runtime.int4_group_size = run.model.int4_weights->group_size;
    run.runtime.int4_zero_points = !run.model.int4_weights->symmetric;
  }
  if (run.runtime.lora.enabled()) {
    // The frozen base stays in its checkpoint's dtype unless told otherwise.
    at::ScalarType base = at::kFloat;
    if (run.lora_base_dtype) {
      base = *run.lora_base_dtype;
    } else if (!run.model_path.empty()) {
      MOEFIT_ASSIGN_OR_RETURN(base, framework::CheckpointBaseDtype(run.model_path));
    }
    run.runtime.dense_dtype = base;
    const bool fp8_config = !run.model_path.empty() && run.model.fp8_weight_block;
    if (!run.experts_dtype_set) {
      run.runtime.expert_dtype = base;
      // A block-scaled FP8 checkpoint's experts stay FP8 where the kernels take them.
      if (!run.lora_base_dtype && fp8_config) {
        MOEFIT_ASSIGN_OR_RETURN(const bool stored_fp8, checkpoint::ExpertsStoredAsFp8(
                                                           run.model_path, run.model.model_type));
        const absl::Status fp8 = framework::CheckFp8Experts(run.model);
        if (stored_fp8 && fp8.ok()) {
          run.runtime.expert_dtype = at::kFloat8_e4m3fn;
        } else if (stored_fp8) {
          log << "moefit: the FP8 experts are dequantized to " << DtypeName(base) << ": "
              << fp8.message() << std::endl;
        }
      }
    }
  }
  // An int4 checkpoint's experts stay int4 wherever nothing trains them (LoRA,
  // moefit eval) and no dtype was asked for.
  if ((run.runtime.lora.enabled() || run.runtime.frozen_base) && !run.experts_dtype_set &&
      !run.lora_base_dtype && !run.model_path.empty() && run.model.int4_weights) {
    MOEFIT_ASSIGN_OR_RETURN(const bool stored_int4,
                            checkpoint::ExpertsStoredAsInt4(run.model_path, run.model.model_type));
    if (stored_int4) run.runtime.expert_dtype = at::kByte;
  }
  if (run.runtime.expert_dtype == at::kByte && run.experts_dtype_set && !run.model_path.empty()) {
    bool stored_int4 = false;
    if (run.model.int4_weights) {
      MOEFIT_ASSIGN_OR_RETURN(
          stored_int4, checkpoint::ExpertsStoredAsInt4(run.model_path, run.model.model_type));
    }
    if (!stored_int4) {
      return absl::InvalidArgumentError(absl::StrCat(
          "experts.dtype = 'int4' keeps the routed experts of a compressed-tensors int4 "
          "checkpoint as stored; those of ",
          run.model_path, " are not pack-quantized int4 (config.json's quantization_config)"));
    }
  }
  if (run.runtime.expert_dtype == at::kFloat8_e4m3fn && run.experts_dtype_set &&
      !run.model_path.empty()) {
    MOEFIT_ASSIGN_OR_RETURN(const bool stored_fp8,
                            checkpoint::ExpertsStoredAsFp8(run.model_path, run.model.model_type));
    if (!stored_fp8) {
      return absl::InvalidArgumentError(absl::StrCat(
          "experts.dtype = 'float8_e4m3fn' keeps the routed experts of a block-scaled FP8 "
          "checkpoint as stored; those of ",
          run.model_path, " are not FP8 with block scales (_scale_inv or _scale)"));
    }
  }
  // int4 experts are allocated in the checkpoint's scheme (its
  // quantization_config's groups and zero points), else in groups of 32.
  if (run.runtime.expert_dtype == at::kByte && run.model.int4_weights) {
    run.runtime.int4_group_size = run.model.int4_weights->group_size;
    run.runtime.int4_zero_points = !run.model.int4_weights->symmetric;
  }
  // Weights that are loaded next are only allocated: no random draw, and the
  // loader fills the model's own tensors, so they are in memory once.
  const framework::WeightInit init = run.model_path.empty() && !run.weights_from_checkpoint
                                         ? framework::WeightInit::kRandom
                                         : framework::WeightInit::kUninitialized;
  MOEFIT_ASSIGN_OR_RETURN(
      out.model, framework::MoeModel::Create(run.model, run.runtime, run.train.seed, init));
  if (!run.model_path.empty() && !run.weights_from_checkpoint) {
    checkpoint::LoadReport report;
    MOEFIT_RETURN_IF_ERROR(framework::LoadPretrained(*out.model, run.model_path, &report));
    log << absl::StrFormat("moefit: loaded %s: %d tensors, %.2f GB read by rank 0 in %.1f s",
                           run.model_path, report.num_tensors_read, report.num_bytes_read / 1e9,
                           report.seconds);
    if (!report.skipped.empty()) {
      log << absl::StrFormat("; %d tensors of the multi-token-prediction layers skipped",
                             report.skipped.size());
    }
    log << std::endl;
  }
  if (!run.lora_init_from.empty() && run.resume_from.empty()) {
    MOEFIT_RETURN_IF_ERROR(framework::LoadAdapter(*out.model, run.lora_init_from));
    log << "moefit: loaded the LoRA adapter " << run.lora_init_from << std::endl;
  }
  // What this rank holds now (the weights, and the peak so far: after loading)
  // and what training will add to it.
  LogMemoryBreakdown(ComputeMemoryBreakdown(*out.model, run.train.micro_batch_size, run.seq_len),
                     *out.groups.world, run.train.micro_batch_size, run.seq_len, log);
  return out;
}

absl::StatusOr<framework::TokenDataset> LoadDataset(const RunConfig& run) {
  if (run.data.format == "jsonl") {
    return framework::TokenDataset::FromJsonl(run.data.path, run.seq_len, run.model.vocab_size);
  }
  if (run.data.path.empty()) {
    return framework::TokenDataset::FromText(ShippedCorpus(), run.seq_len, "<shipped corpus>");
  }
  return framework::TokenDataset::FromTextFile(run.data.path, run.seq_len);
}

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
