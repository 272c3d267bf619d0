// Building a run's model and loading its data; see run_setup.h.
#include "launch/run_setup.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/weight_loader.h"
#include "framework/adapter_io.h"
#include "framework/hf_io.h"
#include "launch/corpus.h"
#include "launch/memory_report.h"
#include "parallel/node_devices.h"
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

}  // namespace moefit::launch
