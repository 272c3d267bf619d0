// The routing-report command; see routing_report_command.h.
#include "launch/routing_report_command.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "framework/model.h"
#include "launch/run_setup.h"
#include "proto/status_macros.h"
#include "router/routing_shares.h"

namespace moefit::launch {
namespace {

using Sequences = std::vector<std::vector<int64_t>>;

// Each sequence's tokens in a seeded random order of their own.
Sequences Shuffled(const Sequences& in, uint64_t seed, int64_t source) {
  Sequences out = in;
  for (size_t s = 0; s < out.size(); ++s) {
    std::seed_seq seq{seed, static_cast<uint64_t>(source), static_cast<uint64_t>(s)};
    std::mt19937_64 gen(seq);
    std::shuffle(out[s].begin(), out[s].end(), gen);
  }
  return out;
}

// Per-sequence counts [S, layers * E] of `seqs` routed by `model`, summed
// over the ranks of `world` (each batch of micro_batch sequences is routed by
// one rank, dealt round-robin).
at::Tensor RouteAndCount(framework::MoeModel& model, const Sequences& seqs, int64_t micro_batch,
                         parallel::Communicator& world) {
  const int64_t s = static_cast<int64_t>(seqs.size());
  const int64_t e = model.options().num_experts;
  const int64_t num_batches = (s + micro_batch - 1) / micro_batch;
  const int64_t rounds = (num_batches + world.size() - 1) / world.size();
  at::Tensor counts;
  for (int64_t round = 0; round < rounds; ++round) {
    const int64_t batch = round * world.size() + world.rank();
    const bool counted = batch < num_batches;
    // A rank past the last batch routes one token, uncounted: every rank
    // must run each forward pass, whose experts live on all of them.
    const int64_t first = counted ? batch * micro_batch : 0;
    const int64_t n = counted ? std::min(micro_batch, s - first) : 1;
    std::vector<int64_t> lengths;
    int64_t longest = 1;
    for (int64_t i = 0; i < n; ++i) {
      lengths.push_back(counted ? static_cast<int64_t>(seqs[first + i].size()) : 1);
      longest = std::max(longest, lengths.back());
    }
    // Padding after each sequence's end: causal attention keeps it out of
    // the real tokens' routing, and its own choices are not counted.
    at::Tensor ids = at::zeros({n, longest}, at::kLong);
    for (int64_t i = 0; counted && i < n; ++i) {
      const std::vector<int64_t>& q = seqs[first + i];
      std::copy(q.begin(), q.end(), ids.data_ptr<int64_t>() + i * longest);
    }
    const framework::ForwardResult out = model.Forward(ids);
    const int64_t layers = static_cast<int64_t>(out.moe_layers.size());
    if (!counts.defined()) counts = at::zeros({s, layers * e}, at::kDouble);
    if (!counted) continue;
    for (int64_t l = 0; l < layers; ++l) {
      counts.narrow(0, first, n)
          .narrow(1, l * e, e)
          .copy_(router::PerSequenceCounts(out.moe_layers[l].topk_idx, lengths, e));
    }
  }
  world.AllReduce(counts, parallel::ReduceOp::kSum)->WaitOrThrow();
  return counts;
}

struct SourceResult {
  std::string path;
  int64_t num_tokens = 0;
  int64_t num_sequences = 0;
  router::ShareEstimates real, control;
};

}  // namespace

absl::StatusOr<Sequences> ReadReportSource(const std::string& path, int64_t seq_len,
                                           int64_t vocab_size, int64_t max_sequences) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--data ", path, ": cannot open"));
  Sequences out;
  const bool jsonl = path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0;
  if (jsonl) {
    std::string line;
    int64_t line_no = 0;
    while (static_cast<int64_t>(out.size()) < max_sequences && std::getline(in, line)) {
      ++line_no;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string where = absl::StrCat(path, ":", line_no);
      const nlohmann::json row = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!row.is_object() || !row.contains("input_ids") || !row["input_ids"].is_array()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": not a JSON object with an \"input_ids\" array"));
      }
      std::vector<int64_t> ids;
      for (const nlohmann::json& v : row["input_ids"]) {
        if (!v.is_number_integer()) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": \"input_ids\" holds a non-integer ", v.dump()));
        }
        const int64_t id = v.get<int64_t>();
        if (id < 0 || id >= vocab_size) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": \"input_ids\" holds ", id, ", outside [0, ", vocab_size, ")"));
        }
        if (static_cast<int64_t>(ids.size()) < seq_len) ids.push_back(id);
      }
      if (!ids.empty()) out.push_back(std::move(ids));
    }
  } else {
    if (vocab_size < 256) {
      return absl::InvalidArgumentError(
          absl::StrCat("--data ", path,
                       ": text goes through the byte tokenizer (256 ids), but the model's "
                       "vocab_size is ",
                       vocab_size, "; give pre-tokenized .jsonl"));
    }
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    for (size_t at = 0; at + 2 <= text.size() && static_cast<int64_t>(out.size()) < max_sequences;
         at += static_cast<size_t>(seq_len)) {
      const size_t n = std::min(text.size() - at, static_cast<size_t>(seq_len));
      std::vector<int64_t> ids;
      for (size_t i = 0; i < n; ++i) ids.push_back(static_cast<unsigned char>(text[at + i]));
      out.push_back(std::move(ids));
    }
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("--data ", path, ": no tokens"));
  return out;
}

absl::Status RunRoutingReport(const RunConfig& run, const RoutingReportOptions& o,
                              std::shared_ptr<parallel::Communicator> world, std::ostream& log_in) {
  std::ostringstream discard;
  std::ostream& log = world->rank() == 0 ? log_in : discard;
  if (o.data.empty()) {
    return absl::InvalidArgumentError(
        "routing-report needs --data FILE, once per data source (.jsonl of input_ids, or text)");
  }
  if (o.num_sequences < 1 || o.num_resamples < 1 || o.top < 1 ||
      !(o.confidence > 0 && o.confidence < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "routing-report: --sequences = ", o.num_sequences, ", --bootstrap = ", o.num_resamples,
        " and --top = ", o.top, " must be positive, --confidence = ", o.confidence, " in (0, 1)"));
  }
  std::vector<Sequences> sources;
  for (const std::string& path : o.data) {
    MOEFIT_ASSIGN_OR_RETURN(
        Sequences seqs, ReadReportSource(path, run.seq_len, run.model.vocab_size, o.num_sequences));
    sources.push_back(std::move(seqs));
  }
  RunConfig frozen = run;
  frozen.runtime.frozen_base = true;
  MOEFIT_ASSIGN_OR_RETURN(ParallelModel built, BuildModel(frozen, world, log));
  framework::MoeModel& model = *built.model;
  torch::NoGradGuard no_grad;
  const framework::ModelOptions& m = model.options();
  const int64_t e = m.num_experts;

  std::vector<SourceResult> results;
  for (size_t i = 0; i < sources.size(); ++i) {
    const Sequences& seqs = sources[i];
    at::Tensor real = RouteAndCount(model, seqs, run.train.micro_batch_size, *world);
    at::Tensor control =
        RouteAndCount(model, Shuffled(seqs, run.train.seed, static_cast<int64_t>(i)),
                      run.train.micro_batch_size, *world);
    SourceResult r;
    r.path = o.data[i];
    r.num_sequences = static_cast<int64_t>(seqs.size());
    std::vector<double> lengths;
    for (const std::vector<int64_t>& q : seqs) {
      lengths.push_back(static_cast<double>(q.size()));
      r.num_tokens += static_cast<int64_t>(q.size());
    }
    if (world->rank() == 0) {
      const at::Tensor tokens = at::tensor(lengths, at::kDouble);
      const uint64_t seed = run.train.seed + 2 * i;
      r.real = router::BootstrapShares(real, tokens, {o.num_resamples, o.confidence, seed});
      r.control =
          router::BootstrapShares(control, tokens, {o.num_resamples, o.confidence, seed + 1});
    }
    results.push_back(std::move(r));
  }
  if (world->rank() != 0) return absl::OkStatus();

  const int64_t columns = static_cast<int64_t>(results[0].real.share.size());
  const int64_t layers = columns / e;
  // MoE layer rows to decoder layer indices.
  std::vector<int64_t> layer_idx;
  for (int64_t l = 0; l < m.num_hidden_layers; ++l) {
    if (m.IsMoeLayer(l)) layer_idx.push_back(l);
  }
  log << absl::StrFormat(
             "routing-report: %s, %d MoE layers x %d experts (top-%d); each expert's share of a "
             "source's tokens with %g%% bootstrap intervals (%d resamples of sequences); control: "
             "the same tokens shuffled within each sequence",
             m.model_type, layers, e, m.num_experts_per_tok, o.confidence * 100, o.num_resamples)
      << std::endl;
  nlohmann::json json = {{"model_type", m.model_type},
                         {"num_experts", e},
                         {"num_experts_per_tok", m.num_experts_per_tok},
                         {"confidence", o.confidence},
                         {"bootstrap_resamples", o.num_resamples},
                         {"sources", nlohmann::json::array()}};
  const bool several = results.size() > 1;
  for (size_t i = 0; i < results.size(); ++i) {
    const SourceResult& r = results[i];
    struct Row {
      int64_t col;
      double others_mean, others_high, lift;
      bool above_others, above_control;
    };
    std::vector<Row> rows;
    for (int64_t c = 0; c < columns; ++c) {
      Row row{c, 0, 0, 0, false, false};
      for (size_t j = 0; j < results.size(); ++j) {
        if (j == i) continue;
        row.others_mean += results[j].real.share[c] / static_cast<double>(results.size() - 1);
        row.others_high = std::max(row.others_high, results[j].real.high[c]);
      }
      const double base = several ? row.others_mean : r.control.share[c];
      row.lift = base > 0 ? r.real.share[c] / base : (r.real.share[c] > 0 ? 1e9 : 1.0);
      row.above_others = several && r.real.low[c] > row.others_high;
      row.above_control = r.real.low[c] > r.control.high[c];
      rows.push_back(row);
    }
    nlohmann::json js = {{"path", r.path},
                         {"sequences", r.num_sequences},
                         {"tokens", r.num_tokens},
                         {"layers", nlohmann::json::array()}};
    for (int64_t l = 0; l < layers; ++l) {
      nlohmann::json jl = {{"layer", layer_idx[l]}, {"experts", nlohmann::json::array()}};
      for (int64_t x = 0; x < e; ++x) {
        const Row& row = rows[l * e + x];
        const int64_t c = row.col;
        jl["experts"].push_back({{"expert", x},
                                 {"share", r.real.share[c]},
                                 {"low", r.real.low[c]},
                                 {"high", r.real.high[c]},
                                 {"control_share", r.control.share[c]},
                                 {"control_low", r.control.low[c]},
                                 {"control_high", r.control.high[c]},
                                 {"lift", row.lift},
                                 {"above_other_sources", row.above_others},
                                 {"above_control", row.above_control}});
      }
      js["layers"].push_back(std::move(jl));
    }
    json["sources"].push_back(std::move(js));

    std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
      if (a.above_others != b.above_others) return a.above_others;
      return a.lift > b.lift;
    });
    log << absl::StrFormat("source %s: %d sequences, %d tokens", r.path, r.num_sequences,
                           r.num_tokens)
        << std::endl;
    log << absl::StrFormat("  %5s %6s  %-24s %-24s %-18s %7s", "layer", "expert",
                           "share [interval]", "control [interval]", several ? "other sources" : "",
                           "lift")
        << std::endl;
    for (int64_t k = 0; k < std::min<int64_t>(o.top, columns); ++k) {
      const Row& row = rows[k];
      const int64_t c = row.col;
      std::string flags;
      if (row.above_others) flags = "takes more than elsewhere";
      if (row.above_control) flags += flags.empty() ? "beyond the tokens" : "; beyond the tokens";
      log << absl::StrFormat(
                 "  %5d %6d  %.4f [%.4f, %.4f]  %.4f [%.4f, %.4f]  %-18s %6.2fx  %s",
                 layer_idx[c / e], c % e, r.real.share[c], r.real.low[c], r.real.high[c],
                 r.control.share[c], r.control.low[c], r.control.high[c],
                 several ? absl::StrFormat("%.4f (<= %.4f)", row.others_mean, row.others_high) : "",
                 row.lift, flags)
          << std::endl;
    }
  }
  if (!o.json_out.empty()) {
    std::ofstream f(o.json_out, std::ios::trunc);
    f << json.dump(1) << '\n';
    f.close();
    if (!f)
      return absl::InvalidArgumentError(absl::StrCat("--json-out ", o.json_out, ": cannot write"));
    log << "routing-report: every layer and expert in " << o.json_out << std::endl;
  }
  return absl::OkStatus();
}

}  // namespace moefit::launch
