// The start-up memory report; see memory_report.h.
#include "launch/memory_report.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "launch/plan_command.h"

namespace moefit::launch {
namespace {

constexpr int64_t kFp32Bytes = 4;
// AdamW keeps two states, m and v, per trained weight.
constexpr int64_t kAdamStates = 2;

// GiB with two decimals, or MiB below one GiB (a small model is not "0.00 GiB").
std::string Size(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / (1 << 30));
  return absl::StrFormat("%.1f MiB", b / (1 << 20));
}

}  // namespace

int64_t ActivationBytesEstimate(const framework::ModelOptions& o, at::ScalarType expert_dtype,
                                int64_t micro_batch, int64_t seq_len) {
  const int64_t tokens = micro_batch * seq_len;
  int64_t num_moe_layers = 0;
  for (int64_t l = 0; l < o.num_hidden_layers; ++l) num_moe_layers += o.IsMoeLayer(l) ? 1 : 0;
  const int64_t dense = tokens * DenseActivationFloatsPerToken(o) * kFp32Bytes;
  const int64_t experts = num_moe_layers * tokens * o.num_experts_per_tok *
                          (o.hidden_size + 2 * o.moe_intermediate_size) *
                          static_cast<int64_t>(c10::elementSize(expert_dtype));
  return dense + experts;
}

absl::StatusOr<int64_t> PeakRssBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    // "VmHWM:     123456 kB"
    if (!line.starts_with("VmHWM:")) continue;
    long long kib = 0;  // NOLINT(runtime/int): sscanf's %lld
    if (std::sscanf(line.c_str(), "VmHWM: %lld kB", &kib) != 1) {
      return absl::InternalError(absl::StrCat("/proc/self/status: cannot read \"", line, "\""));
    }
    return static_cast<int64_t>(kib) * 1024;
  }
  return absl::NotFoundError("/proc/self/status: no VmHWM");
}

MemoryBreakdown ComputeMemoryBreakdown(const framework::MoeModel& model, int64_t micro_batch,
                                       int64_t seq_len) {
  MemoryBreakdown m;
  auto add_weight = [&](const at::Tensor& t) {
    const auto bytes = static_cast<int64_t>(t.nbytes());
    m.weight_bytes += bytes;
    if (t.device().is_cpu()) m.host_weight_bytes += bytes;
  };
  for (const framework::Parameter& p : model.parameters()) add_weight(p.tensor);
  for (const framework::Parameter& p : model.adapters()) add_weight(p.tensor);
  for (const framework::Parameter& b : model.buffers()) add_weight(b.tensor);
  for (const at::Tensor& t : model.expert_copies()) add_weight(t);
  // Each trained tensor (the adapters alone under LoRA) has a float32
  // gradient like it, and AdamW's m and v.
  for (const framework::Parameter& p : model.trainable_parameters()) {
    m.gradient_bytes += static_cast<int64_t>(p.tensor.nbytes());
  }
  m.optimizer_bytes = kAdamStates * m.gradient_bytes;
  m.activation_bytes = ActivationBytesEstimate(
      model.options(), model.runtime().expert_compute_dtype(), micro_batch, seq_len);
  absl::StatusOr<int64_t> peak = PeakRssBytes();
  m.peak_rss_bytes = peak.ok() ? *peak : 0;
  return m;
}

MemoryBreakdown MaxOverRanks(const MemoryBreakdown& mine, parallel::Communicator& world) {
  at::Tensor v = at::tensor({mine.weight_bytes, mine.host_weight_bytes, mine.gradient_bytes,
                             mine.optimizer_bytes, mine.activation_bytes, mine.peak_rss_bytes},
                            at::kLong);
  world.AllReduce(v, parallel::ReduceOp::kMax)->WaitOrThrow();
  const int64_t* p = v.data_ptr<int64_t>();
  return {.weight_bytes = p[0],
          .host_weight_bytes = p[1],
          .gradient_bytes = p[2],
          .optimizer_bytes = p[3],
          .activation_bytes = p[4],
          .peak_rss_bytes = p[5]};
}

std::string FormatMemoryBreakdown(const MemoryBreakdown& m, int64_t micro_batch, int64_t seq_len) {
  return absl::StrCat("weights ", Size(m.weight_bytes), " (", Size(m.host_weight_bytes),
                      " in host RAM), gradients ", Size(m.gradient_bytes), ", AdamW m+v ",
                      Size(m.optimizer_bytes), ", activations ~", Size(m.activation_bytes),
                      " per micro-batch of ", micro_batch, " x ", seq_len,
                      " tokens (estimate); peak RSS ",
                      m.peak_rss_bytes > 0 ? Size(m.peak_rss_bytes) : "unknown");
}

void LogMemoryBreakdown(const MemoryBreakdown& mine, parallel::Communicator& world,
                        int64_t micro_batch, int64_t seq_len, std::ostream& log) {
  log << "moefit: memory of rank 0: " << FormatMemoryBreakdown(mine, micro_batch, seq_len)
      << std::endl;
  if (world.size() == 1) return;
  const MemoryBreakdown most = MaxOverRanks(mine, world);
  log << "moefit: largest over " << world.size()
      << " ranks: " << FormatMemoryBreakdown(most, micro_batch, seq_len) << std::endl;
}

ExpertMemory ComputeExpertMemory(const framework::MoeModel& model) {
  ExpertMemory m;
  for (const framework::Parameter& p : model.parameters()) {
    if (p.expert) m.tensor_bytes += static_cast<int64_t>(p.tensor.nbytes());
  }
  for (const at::Tensor& t : model.expert_copies())
    m.tensor_bytes += static_cast<int64_t>(t.nbytes());
  m.pack_bytes = model.expert_pack_bytes();
  const framework::ParameterCounts c = framework::CountParameters(model.options());
  const int ep_rank = model.runtime().expert_group ? model.runtime().expert_group->rank() : 0;
  m.num_params = model.placement().num_local(ep_rank) * c.num_moe_layers * c.per_expert;
  return m;
}

namespace {

std::string FormatEndMemory(int64_t peak_rss, const ExpertMemory& e) {
  std::string out =
      absl::StrCat("peak RSS ", peak_rss > 0 ? Size(peak_rss) : "unknown", "; routed experts ",
                   Size(e.tensor_bytes), " + ", Size(e.pack_bytes), " kept packs for ",
                   e.num_params, " parameters");
  if (e.num_params > 0) {
    const auto per = [&](int64_t bytes) {
      return static_cast<double>(bytes) / static_cast<double>(e.num_params);
    };
    absl::StrAppendFormat(&out, " (%.4f + %.4f bytes each)", per(e.tensor_bytes),
                          per(e.pack_bytes));
  }
  return out;
}

}  // namespace

void LogEndMemory(const framework::MoeModel& model, parallel::Communicator& world,
                  std::ostream& log) {
  const ExpertMemory mine = ComputeExpertMemory(model);
  absl::StatusOr<int64_t> peak = PeakRssBytes();
  const int64_t peak_rss = peak.ok() ? *peak : 0;
  log << "moefit: memory at the end, rank 0: " << FormatEndMemory(peak_rss, mine) << std::endl;
  if (world.size() == 1) return;
  at::Tensor v =
      at::tensor({peak_rss, mine.tensor_bytes, mine.pack_bytes, mine.num_params}, at::kLong);
  world.AllReduce(v, parallel::ReduceOp::kMax)->WaitOrThrow();
  const int64_t* p = v.data_ptr<int64_t>();
  log << "moefit: memory at the end, largest over " << world.size() << " ranks: "
      << FormatEndMemory(p[0], {.tensor_bytes = p[1], .pack_bytes = p[2], .num_params = p[3]})
      << std::endl;
}

}  // namespace moefit::launch
