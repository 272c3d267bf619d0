// The eval command; see eval_command.h.
#include "launch/eval_command.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_io.h"
#include "framework/data.h"
#include "framework/hf_io.h"
#include "framework/model.h"
#include "launch/run_setup.h"
#include "parallel/process_groups.h"
#include "proto/status_macros.h"

namespace moefit::launch {

absl::Status RunEval(const RunConfig& run, const EvalOptions& options,
                     std::shared_ptr<parallel::Communicator> world, std::ostream& log_in) {
  std::ostringstream discard;
  std::ostream& log = world->rank() == 0 ? log_in : discard;
  if (options.num_sequences < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--eval_sequences = ", options.num_sequences, " must be positive"));
  }
  if (!options.save_logits.empty() && options.input_ids.empty()) {
    return absl::InvalidArgumentError("--save_logits needs --input_ids FILE (a safetensors file with \"input_ids\")");
  }
  // Nothing is trained: FP8 experts (experts.dtype=float8_e4m3fn) may stay FP8.
  RunConfig frozen = run;
  frozen.runtime.frozen_base = true;
  MOEFIT_ASSIGN_OR_RETURN(ParallelModel built, BuildModel(frozen, world, log));
  std::unique_ptr<framework::MoeModel>& model = built.model;
  torch::NoGradGuard no_grad;

  if (!options.save_logits.empty()) {
    MOEFIT_ASSIGN_OR_RETURN(checkpoint::SafetensorsFile in,
                            checkpoint::SafetensorsFile::Open(options.input_ids));
    MOEFIT_ASSIGN_OR_RETURN(at::Tensor ids, checkpoint::ReadTensor(in, "input_ids", {.dtype = at::kLong}));
    if (ids.dim() != 2 || ids.min().item<int64_t>() < 0 ||
        ids.max().item<int64_t>() >= run.model.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          options.input_ids, ": input_ids must be [batch, tokens] with ids in [0, ",
          run.model.vocab_size, "), got shape ", c10::str(ids.sizes())));
    }
    at::Tensor logits = model->Forward(ids).logits.to(at::kCPU).contiguous();
    if (world->rank() == 0) {
      MOEFIT_RETURN_IF_ERROR(checkpoint::SaveTensors(options.save_logits, {{"logits", logits}}));
      log << "moefit: logits " << c10::str(logits.sizes()) << " written to " << options.save_logits
          << std::endl;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<framework::TokenDataset> data = LoadDataset(run);
  if (!data.ok()) return data.status();
  const int64_t n = std::min(options.num_sequences, data->num_sequences());
  // Every rank runs the same number of batches (the experts need all ranks);
  // a rank past the end runs an empty share.
  const int64_t per_rank = (n + world->size() - 1) / world->size();
  const int64_t mb = run.train.micro_batch_size;
  double loss_sum = 0;
  int64_t tokens = 0;
  for (int64_t begin = 0; begin < per_rank; begin += mb) {
    std::vector<int64_t> idx;
    for (int64_t i = begin; i < std::min(begin + mb, per_rank); ++i) {
      const int64_t seq = world->rank() * per_rank + i;
      if (seq < n) idx.push_back(seq);
    }
    if (idx.empty()) idx.push_back(0);  // keeps the collectives aligned; not counted
    framework::Batch b = data->Gather(idx);
    framework::LossSum l = framework::CausalLmLossSum(
        model->Forward(b.input_ids, b.position_ids, b.segment_ids).logits, b.labels);
    if (world->rank() * per_rank + begin < n) {
      loss_sum += l.sum.item<double>();
      tokens += l.num_tokens;
    }
  }
  at::Tensor sums = at::tensor({loss_sum, static_cast<double>(tokens)}, at::kDouble);
  world->AllReduce(sums, parallel::ReduceOp::kSum)->WaitOrThrow();
  const double loss = sums[0].item<double>() / std::max(1.0, sums[1].item<double>());
  log << absl::StrFormat("eval: %d sequences of %d tokens, %.0f trained tokens: loss %.4f, perplexity %.3f",
                         n, run.seq_len, sums[1].item<double>(), loss, std::exp(loss))
      << std::endl;
  return absl::OkStatus();
}

}  // namespace moefit::launch
