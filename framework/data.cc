// Token datasets and the sampler; see data.h.
#include "framework/data.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moefit::framework {
namespace {

// First fit over sequences of `capacity` tokens: the leftmost sequence with
// room for `need` tokens, found in O(log n) through a max-tree over the free
// room of each (a linear scan would make packing quadratic in the samples).
// Unused sequences are all free, so new ones are opened in order.
class FirstFit {
 public:
  FirstFit(int64_t max_sequences, int64_t capacity) {
    while (leaves_ < max_sequences) leaves_ *= 2;
    free_.assign(2 * leaves_, capacity);
  }
  // Index of the sequence that takes `need` (<= capacity) tokens.
  int64_t Place(int64_t need) {
    int64_t node = 1;
    while (node < leaves_) node = free_[2 * node] >= need ? 2 * node : 2 * node + 1;
    free_[node] -= need;
    const int64_t seq = node - leaves_;
    for (node /= 2; node >= 1; node /= 2) {
      free_[node] = std::max(free_[2 * node], free_[2 * node + 1]);
    }
    return seq;
  }

 private:
  int64_t leaves_ = 1;
  std::vector<int64_t> free_;
};

absl::Status CheckSeqLen(int64_t seq_len) {
  if (seq_len < 2) {
    return absl::InvalidArgumentError(absl::StrCat("train.seq_len = ", seq_len, " must be >= 2"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TokenDataset> TokenDataset::FromText(std::string_view text, int64_t seq_len,
                                                    std::string_view source) {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  std::vector<int64_t> labels = ids;
  return Chunk(std::move(ids), std::move(labels), seq_len, source);
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
  if (absl::Status s = CheckSeqLen(seq_len); !s.ok()) return s;
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("data.path: cannot open '", path, "'"));
  // All samples' tokens back to back; sample i is [starts[i], starts[i + 1]).
  std::vector<int64_t> ids, labels, starts = {0};
  std::string line;
  for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = absl::StrCat(path, ":", line_no);
    nlohmann::json row = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (row.is_discarded() || !row.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": not a JSON object"));
    }
    // Ids in [0, vocab_size); labels also -100.
    auto read_ints = [&](const char* key, bool allow_ignore,
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
        if ((id < 0 || id >= vocab_size) && !(allow_ignore && id == kIgnoreIndex)) {
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
    if (absl::Status s = read_ints("input_ids", false, &ids); !s.ok()) return s;
    if (row.contains("labels")) {
      if (absl::Status s = read_ints("labels", true, &labels); !s.ok()) return s;
      if (labels.size() != ids.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": \"labels\" has ", labels.size() - before, " entries, \"input_ids\" ",
                         ids.size() - before));
      }
    } else {
      labels.insert(labels.end(), ids.begin() + before, ids.end());
    }
    if (ids.size() > before) starts.push_back(static_cast<int64_t>(ids.size()));
  }
  if (ids.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no samples with tokens"));
  }

  // Pieces of at most seq_len tokens (whole samples, or the cuts of a longer
  // one), each placed by first fit in file order.
  struct Piece {
    int64_t begin, size, seq, offset;  // tokens [begin, begin + size) -> row seq at offset
  };
  std::vector<Piece> pieces;
  for (size_t i = 0; i + 1 < starts.size(); ++i) {
    for (int64_t b = starts[i]; b < starts[i + 1]; b += seq_len) {
      pieces.push_back({b, std::min(seq_len, starts[i + 1] - b), 0, 0});
    }
  }
  FirstFit fit(static_cast<int64_t>(pieces.size()), seq_len);
  std::vector<int64_t> used;  // tokens placed in each sequence so far
  for (Piece& p : pieces) {
    p.seq = fit.Place(p.size);
    if (p.seq == static_cast<int64_t>(used.size())) used.push_back(0);
    p.offset = used[p.seq];
    used[p.seq] += p.size;
  }
  const int64_t num_seq = static_cast<int64_t>(used.size());
  TokenDataset d;
  // Padding: token 0 (any valid id; nothing attends to it or learns from it).
  d.input_ids_ = at::zeros({num_seq, seq_len}, at::kLong);
  d.labels_ = at::full({num_seq, seq_len}, kIgnoreIndex, at::kLong);
  d.position_ids_ = at::zeros({num_seq, seq_len}, at::kLong);
  d.segment_ids_ = at::zeros({num_seq, seq_len}, at::kLong);
  int64_t* out_ids = d.input_ids_.data_ptr<int64_t>();
  int64_t* out_labels = d.labels_.data_ptr<int64_t>();
  int64_t* out_pos = d.position_ids_.data_ptr<int64_t>();
  int64_t* out_seg = d.segment_ids_.data_ptr<int64_t>();
  std::vector<int64_t> segments(num_seq, 0);  // segments written into each sequence
  for (const Piece& p : pieces) {
    const int64_t dst = p.seq * seq_len + p.offset;
    std::copy_n(ids.begin() + p.begin, p.size, out_ids + dst);
    // The first token is never a target: its predecessor is another segment.
    std::copy_n(labels.begin() + p.begin + 1, p.size - 1, out_labels + dst + 1);
    for (int64_t j = 0; j < p.size; ++j) {
      out_pos[dst + j] = j;
      out_seg[dst + j] = segments[p.seq];
    }
    ++segments[p.seq];
  }
  for (int64_t s = 0; s < num_seq; ++s) {  // the padding after the samples: one more segment
    for (int64_t j = used[s]; j < seq_len; ++j) {
      out_pos[s * seq_len + j] = j - used[s];
      out_seg[s * seq_len + j] = segments[s];
    }
  }
  return d;
}

absl::StatusOr<TokenDataset> TokenDataset::Chunk(std::vector<int64_t> ids,
                                                 std::vector<int64_t> labels, int64_t seq_len,
                                                 std::string_view source) {
  if (absl::Status s = CheckSeqLen(seq_len); !s.ok()) return s;
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
  Batch b{input_ids_.index_select(0, idx), labels_.index_select(0, idx)};
  if (position_ids_.defined()) {
    b.position_ids = position_ids_.index_select(0, idx);
    b.segment_ids = segment_ids_.index_select(0, idx);
  } else {
    const int64_t rows = static_cast<int64_t>(seq_idx.size());
    b.position_ids = at::arange(seq_len(), at::kLong).expand({rows, seq_len()}).contiguous();
    b.segment_ids = at::zeros({rows, seq_len()}, at::kLong);
  }
  return b;
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
