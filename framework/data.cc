// Token datasets and the sampler; see data.h.
#include "framework/data.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moefit::framework {

absl::StatusOr<TokenDataset> TokenDataset::FromText(std::string_view text, int64_t seq_len,
                                                    std::string_view source) {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  std::vector<int64_t> labels = ids;
  return Pack(std::move(ids), std::move(labels), seq_len, source);
}

absl::StatusOr<TokenDataset> TokenDataset::FromTextFile(const std::string& path,
                                                        int64_t seq_len) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("data.path: cannot open '", path, "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  return FromText(ss.str(), seq_len, path);
}

absl::StatusOr<TokenDataset> TokenDataset::FromJsonl(const std::string& path, int64_t seq_len,
                                                     int64_t vocab_size) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("data.path: cannot open '", path, "'"));
  std::vector<int64_t> ids, labels;
  std::string line;
  for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = absl::StrCat(path, ":", line_no);
    nlohmann::json row = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (row.is_discarded() || !row.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": not a JSON object"));
    }
    auto read_ints = [&](const char* key, int64_t lo,
                         std::vector<int64_t>* out) -> absl::Status {
      const auto& arr = row[key];
      if (!arr.is_array()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": \"", key, "\" must be an array of integers"));
      }
      for (const auto& v : arr) {
        if (!v.is_number_integer()) {
          return absl::InvalidArgumentError(absl::StrCat(where, ": \"", key, "\" holds a non-integer ", v.dump()));
        }
        const int64_t id = v.get<int64_t>();
        if ((id < lo || id >= vocab_size) && !(lo < 0 && id == kIgnoreIndex)) {
          return absl::InvalidArgumentError(absl::StrCat(where, ": \"", key, "\" holds ", id,
                                                         ", outside [0, ", vocab_size, ")"));
        }
        out->push_back(id);
      }
      return absl::OkStatus();
    };
    if (!row.contains("input_ids")) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": missing \"input_ids\""));
    }
    const size_t before = ids.size();
    if (absl::Status s = read_ints("input_ids", 0, &ids); !s.ok()) return s;
    if (row.contains("labels")) {
      if (absl::Status s = read_ints("labels", kIgnoreIndex, &labels); !s.ok()) return s;
      if (labels.size() != ids.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": \"labels\" has ", labels.size() - before, " entries, \"input_ids\" ",
                         ids.size() - before));
      }
    } else {
      labels.insert(labels.end(), ids.begin() + before, ids.end());
    }
  }
  return Pack(std::move(ids), std::move(labels), seq_len, path);
}

absl::StatusOr<TokenDataset> TokenDataset::Pack(std::vector<int64_t> ids,
                                                std::vector<int64_t> labels, int64_t seq_len,
                                                std::string_view source) {
  if (seq_len < 2) {
    return absl::InvalidArgumentError(absl::StrCat("train.seq_len = ", seq_len, " must be >= 2"));
  }
  const int64_t num_seq = static_cast<int64_t>(ids.size()) / seq_len;
  if (num_seq == 0) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(source), ": ", ids.size(),
                                                   " tokens, fewer than one sequence of train.seq_len = ",
                                                   seq_len));
  }
  TokenDataset d;
  d.input_ids_ = at::from_blob(ids.data(), {num_seq, seq_len}, at::kLong).clone();
  d.labels_ = at::from_blob(labels.data(), {num_seq, seq_len}, at::kLong).clone();
  return d;
}

Batch TokenDataset::Gather(const std::vector<int64_t>& seq_idx) const {
  at::Tensor idx = at::tensor(seq_idx, at::kLong);
  return {input_ids_.index_select(0, idx), labels_.index_select(0, idx)};
}

BatchSampler::BatchSampler(int64_t num_sequences, uint64_t seed)
    : num_sequences_(num_sequences), seed_(seed) {}

const std::vector<int64_t>& BatchSampler::Epoch(int64_t epoch) {
  if (epoch != cached_epoch_) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed_ + 1000003ULL * epoch);
    at::Tensor perm = at::randperm(num_sequences_, gen, at::kLong);
    cached_perm_.assign(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + num_sequences_);
    cached_epoch_ = epoch;
  }
  return cached_perm_;
}

std::vector<int64_t> BatchSampler::GlobalBatch(int64_t step, int64_t size) {
  std::vector<int64_t> out;
  out.reserve(size);
  for (int64_t pos = step * size; pos < (step + 1) * size; ++pos) {
    out.push_back(Epoch(pos / num_sequences_)[pos % num_sequences_]);
  }
  return out;
}

}  // namespace moefit::framework
