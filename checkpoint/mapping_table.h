// Per-family mapping tables: how a Hub checkpoint's tensors become moefit's runtime tensors.
//
// Checkpoints on the Hub store routed experts one Linear at a time
// (`model.layers.3.mlp.experts.17.gate_proj.weight`); moefit computes on packed
// per-layer tensors (`model.layers.3.mlp.experts.gate_up_proj` [E, 2I, H]).
// Instead of code per family, each family has one table file under
// checkpoint/mappings/ (protobuf text format, schema proto/checkpoint_mapping.proto)
// listing declarative rules in the load direction: source key patterns, a target
// name pattern and a list of operations (merge / split the expert list,
// concatenate / chunk, transpose, interleave / deinterleave, cast). Export runs
// each rule backwards through ReverseOps(), so one table serves both directions.
// The table files are compiled into the library; adding a family means adding a
// table file and its name to the list in checkpoint/CMakeLists.txt.
//
// This header is torch-free: it only describes rules. conversion_ops.h executes
// them, weight_loader.h and weight_exporter.h drive whole checkpoints.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "checkpoint/safetensors.h"

namespace moefit::checkpoint {

// One operation of a rule. `dim` / `dim1` count from 0 or from the end when negative.
struct ConversionOp {
  enum class Kind : uint8_t {
    kMergeModulelist,  // stack each source's per-expert tensors along dim
    kSplitModulelist,  // unbind along dim into per-expert tensors
    kConcatenate,      // cat the sources' tensors along dim
    kChunk,            // split one tensor into num_chunks equal parts along dim
    kTranspose,        // swap dim and dim1
    kInterleave,       // halves [a; b] along dim -> a0 b0 a1 b1 ...
    kDeinterleave,     // a0 b0 a1 b1 ... along dim -> [a; b] (even rows first)
    kCast,             // convert to dtype
  };

  Kind kind = Kind::kMergeModulelist;
  int64_t dim = 0;
  int64_t dim1 = 0;                    // kTranspose only
  int64_t num_chunks = 0;              // kChunk only
  Dtype dtype = Dtype::kF32;           // kCast only
  std::optional<Dtype> reverse_dtype;  // kCast only: what export converts back to

  // The operation that undoes this one. A cast is undone by a cast to
  // reverse_dtype, or by nothing (nullopt) when there is none.
  std::optional<ConversionOp> Inverse() const;
  // "merge_modulelist(dim=0)", for messages.
  std::string DebugString() const;
};

// Key patterns: `*` stands for a decimal number without leading zeros (a layer
// or expert index); everything else matches itself.
class KeyPattern {
 public:
  KeyPattern() = default;
  explicit KeyPattern(std::string_view pattern);

  const std::string& text() const { return text_; }
  int num_wildcards() const { return static_cast<int>(pieces_.size()) - 1; }

  // The numbers standing for the `*`s, in order, or nullopt when `name` does not match.
  std::optional<std::vector<int64_t>> Match(std::string_view name) const;
  // The name with the `*`s replaced by `numbers` (num_wildcards() of them).
  std::string Fill(const std::vector<int64_t>& numbers) const;

 private:
  std::string text_;
  std::vector<std::string> pieces_;  // the literal text between the `*`s
};

// Sources -> target in the load direction (see proto/checkpoint_mapping.proto).
struct MappingRule {
  std::vector<KeyPattern> sources;  // on-disk patterns
  KeyPattern target;                // runtime pattern
  std::vector<ConversionOp> ops;    // load direction
  // Sources hold all experts of a layer packed along dim 0.
  bool packed_experts = false;
  // Line of the rule in its table file, for messages.
  int line = 0;

  // True when the ops start with a merge of per-expert sources: the last `*` of
  // each source is then the expert index.
  bool merges_experts() const;
  // True when the target holds one slice of the experts per rank (merged or packed).
  bool is_expert_rule() const { return merges_experts() || packed_experts; }
  // The export direction: the inverse ops in reverse order (casts without a
  // reverse dtype are dropped).
  std::vector<ConversionOp> ReverseOps() const;
};

struct MappingTable {
  std::string family;
  std::string file;  // where the table came from, for messages
  std::vector<MappingRule> rules;
  std::vector<KeyPattern> ignore;
  // Runtime tensors exported in float32 whatever the export dtype.
  std::vector<KeyPattern> keep_float32;
};

// Parses a table in text format and checks it: every rule has a source; a target
// (or, when omitted, the single source) whose `*`s agree with the sources' (one
// fewer with merge_modulelist); one source per rule unless it concatenates;
// known dtype names; dims of transposes distinct. Errors (InvalidArgument) read
// "<file>:<line>:<column>: <what>", lines counted from 1.
absl::StatusOr<MappingTable> ParseMappingTable(std::string_view text, std::string_view file);

// The compiled-in table of `family` ("deepseek_v3", "glm4_moe", "mixtral",
// "qwen2_moe", "qwen3_moe"). NotFound lists the known families.
absl::StatusOr<MappingTable> MappingTableFor(std::string_view family);

// Families with a compiled-in table, by name.
std::vector<std::string> RegisteredFamilies();

}  // namespace moefit::checkpoint
