// What one rank of a run holds in memory, printed at start-up.
//
// The weights are allocated once and filled in place by the checkpoint loader
// (framework/hf_io.h), so after loading a rank's resident memory is its
// parameters plus a fixed overhead (LibTorch, MPI, the dataset). This report
// makes that footprint visible before any step runs, together with what
// training adds to it: a gradient and AdamW's m and v per trained parameter
// (torch::optim::AdamW keeps both states in the parameter's dtype), and an
// estimate of the activations one micro-batch keeps for backward. Under mpirun
// the rank with the most experts is the one that has to fit, so rank 0's
// figures and the largest of each over the ranks are printed.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "framework/model.h"
#include "framework/model_options.h"
#include "parallel/communicator.h"

namespace moefit::launch {

// Bytes, on one rank.
struct MemoryBreakdown {
  int64_t weight_bytes = 0;       // parameters and buffers, on every device
  int64_t host_weight_bytes = 0;  // of which in host RAM (the routed experts; all on a CPU run)
  int64_t gradient_bytes = 0;     // one gradient per trained parameter, in its dtype
  int64_t optimizer_bytes = 0;    // AdamW m and v per trained parameter, in its dtype
  int64_t activation_bytes = 0;   // ActivationBytesEstimate for one micro-batch
  int64_t peak_rss_bytes = 0;     // VmHWM when the breakdown was taken; 0: unknown
};

// The activations one micro-batch of `micro_batch` sequences of `seq_len`
// tokens keeps for backward on one rank, estimated as
//
//   micro_batch x seq_len x DenseActivationFloatsPerToken(model) x 4
//     + num_moe_layers x micro_batch x seq_len x top_k
//         x (hidden + 2 x moe_intermediate) x sizeof(expert_dtype)
//
// The first term is the dense part in fp32, per token and layer as `moefit
// plan` counts it (launch/plan_command.h: block inputs and norm outputs, every
// projection's output, the MLP or shared-expert intermediates, router scores,
// the top_k expert rows, the logits and their gradient). The second is the
// expert rows this rank computes per MoE layer: with balanced routing the
// top_k picks of the expert group's tokens spread evenly over its ranks, so a
// rank computes as many rows as its own tokens make, each keeping its input
// and its gate/up outputs in the experts' dtype. Transient per-layer buffers
// and the collectives' staging copies are not counted.
int64_t ActivationBytesEstimate(const framework::ModelOptions& model, at::ScalarType expert_dtype,
                                int64_t micro_batch, int64_t seq_len);

// The peak resident set size of this process so far: VmHWM of
// /proc/self/status, in bytes. NotFound where the file or the field is absent.
absl::StatusOr<int64_t> PeakRssBytes();

// The breakdown of this rank's `model`, for micro-batches of `micro_batch`
// sequences of `seq_len` tokens; peak_rss_bytes is PeakRssBytes() now (0 when
// unknown).
MemoryBreakdown ComputeMemoryBreakdown(const framework::MoeModel& model, int64_t micro_batch,
                                       int64_t seq_len);

// Collective over `world`: the largest value of each figure over the ranks.
MemoryBreakdown MaxOverRanks(const MemoryBreakdown& mine, parallel::Communicator& world);

// One line of figures (GiB, or MiB below one GiB), without a trailing newline.
std::string FormatMemoryBreakdown(const MemoryBreakdown& m, int64_t micro_batch, int64_t seq_len);

// Collective over `world`: writes to `log` rank 0's breakdown and, with more
// than one rank, the largest figures over the ranks (what the biggest rank
// needs). Call it on every rank; only the caller's `log` of rank 0 should print.
void LogMemoryBreakdown(const MemoryBreakdown& mine, parallel::Communicator& world,
                        int64_t micro_batch, int64_t seq_len, std::ostream& log);

// What one rank's routed experts hold, to judge a weight format by: their
// tensors (weights; FP8 and int4 scales and zero points; compute copies of
// float32 masters; not their LoRA adapters, which are trainable state like
// any other), the expert kernels' kept packs of them, and the expert
// parameters they stand for (3 x hidden x moe_intermediate per expert and
// MoE layer on this rank, whatever the storage).
struct ExpertMemory {
  int64_t tensor_bytes = 0;
  int64_t pack_bytes = 0;  // MoeModel::expert_pack_bytes() now
  int64_t num_params = 0;
};

ExpertMemory ComputeExpertMemory(const framework::MoeModel& model);

// Collective over `world`, after training: writes to `log` rank 0's peak RSS
// (VmHWM) and ExpertMemory with the bytes per expert parameter, and with more
// than one rank the largest of each figure over the ranks. Call it on every
// rank; only rank 0's `log` should print.
void LogEndMemory(const framework::MoeModel& model, parallel::Communicator& world,
                  std::ostream& log);

}  // namespace moefit::launch
