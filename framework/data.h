// Training data: token sequences of a fixed length and a deterministic sampler.
//
// Two sources, laid out differently:
//  * Plain text through the byte-level tokenizer (token = byte, vocabulary
//    256; what the demo uses) is one continuous stream cut into sequences of
//    `seq_len` tokens (a shorter tail is dropped): each sequence is one
//    segment with positions 0..T-1.
//  * Pre-tokenized JSON Lines ({"input_ids": [...], "labels": [...]}, label
//    -100 = not trained on, labels defaulting to input_ids) are samples that
//    must not see each other: whole samples are packed into sequences of
//    `seq_len` tokens, first fit in file order (each sample goes into the
//    first sequence with room for it, else a new one), and the rest of a
//    sequence is padding (token 0, label -100, a segment of its own). A sample
//    longer than `seq_len` is split into pieces of `seq_len` tokens (the last
//    one shorter), each packed as a sample of its own. Every sample (or piece)
//    is a segment: its position ids restart at 0, attention stays inside it
//    (MoeModel::Forward), and its first token's label is -100, because the
//    loss predicts labels[t + 1] from position t and the token before a
//    segment belongs to another one — the sample alone never predicts its
//    first token either.
//
// The sampler visits the sequences in a fresh seeded permutation each epoch,
// so a global batch is a pure function of (seed, step) — the property
// multi-rank runs rely on to equal a single-rank run over the same global
// batch.
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
  at::Tensor input_ids;     // [B, T] int64
  at::Tensor labels;        // [B, T] int64, -100 where not trained on
  at::Tensor position_ids;  // [B, T] int64, 0 at the first token of every segment
  at::Tensor segment_ids;   // [B, T] int64, 0, 1, ... for the segments of each row
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
  // The text layout: consecutive chunks of one stream.
  static absl::StatusOr<TokenDataset> Chunk(std::vector<int64_t> ids, std::vector<int64_t> labels,
                                            int64_t seq_len, std::string_view source);
  at::Tensor input_ids_;  // [S, T]
  at::Tensor labels_;     // [S, T]
  // [S, T] for packed samples; undefined for a stream (positions 0..T-1, one
  // segment per row, made by Gather).
  at::Tensor position_ids_, segment_ids_;
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
