// Training data: token sequences of a fixed length and a deterministic sampler.
//
// Two sources: plain text through the byte-level tokenizer (token = byte,
// vocabulary 256; what the demo uses), and pre-tokenized JSON Lines
// ({"input_ids": [...], "labels": [...]}, label -100 = not trained on, labels
// defaulting to input_ids). Both are concatenated and packed into sequences of
// `seq_len` tokens; a tail shorter than that is dropped. The sampler visits the
// sequences in a fresh seeded permutation each epoch, so a global batch is a
// pure function of (seed, step) — the property multi-rank runs rely on to equal
// a single-rank run over the same global batch.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace moefit::framework {

constexpr int64_t kByteVocabSize = 256;
constexpr int64_t kIgnoreIndex = -100;

struct Batch {
  at::Tensor input_ids;  // [B, T] int64
  at::Tensor labels;     // [B, T] int64, -100 where not trained on
};

class TokenDataset {
 public:
  // Byte-level tokenization of `text`; `source` names it in errors.
  static absl::StatusOr<TokenDataset> FromText(std::string_view text, int64_t seq_len,
                                               std::string_view source);
  static absl::StatusOr<TokenDataset> FromTextFile(const std::string& path, int64_t seq_len);
  // Every id must lie in [0, vocab_size); errors name the file and line.
  static absl::StatusOr<TokenDataset> FromJsonl(const std::string& path, int64_t seq_len,
                                                int64_t vocab_size);

  int64_t num_sequences() const { return input_ids_.size(0); }
  int64_t seq_len() const { return input_ids_.size(1); }
  // Rows of the given sequences, in order.
  Batch Gather(const std::vector<int64_t>& seq_idx) const;

 private:
  static absl::StatusOr<TokenDataset> Pack(std::vector<int64_t> ids, std::vector<int64_t> labels,
                                           int64_t seq_len, std::string_view source);
  at::Tensor input_ids_;  // [S, T]
  at::Tensor labels_;     // [S, T]
};

class BatchSampler {
 public:
  BatchSampler(int64_t num_sequences, uint64_t seed);
  // Sequence indices of global batch `step`: positions [step*size, (step+1)*size)
  // of the concatenation of per-epoch permutations.
  std::vector<int64_t> GlobalBatch(int64_t step, int64_t size);

 private:
  const std::vector<int64_t>& Epoch(int64_t epoch);
  int64_t num_sequences_;
  uint64_t seed_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> cached_perm_;
};

}  // namespace moefit::framework
