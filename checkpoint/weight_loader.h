// Loading a Hub checkpoint directory into moefit's runtime tensors, lazily and per rank.
//
// A rank of an expert-parallel job needs the dense tensors and only its own
// slice of each layer's experts. LoadCheckpoint therefore plans before it reads:
// it lists the keys once (from model.safetensors.index.json when present, else
// from every *.safetensors header in the directory; opening a shard reads only
// its header), matches them against the family's mapping table, picks for each
// wanted target the sources it needs (for a packed expert target on this rank,
// only this rank's experts' per-expert tensors, or only this rank's rows of a
// packed source), checks every shape by running the rule on meta tensors, and
// fails with one message naming every missing, unexpected and mis-shaped tensor
// before touching any data. Only then does it read: each target's sources go
// straight to their place in the target's own tensor (pread() when no dtype
// conversion is needed, else a converting copy from the read-only mapping), as
// soon as they are read (that tensor can be the caller's own, a model's
// parameter: LoadOptions::destinations, so a loaded model holds its weights
// once), on a oneTBB flow graph that keeps a bounded number of targets in
// flight (so extra memory is a few targets, not the checkpoint). The report
// counts the bytes actually read, so tests can check that a rank reads only
// its own experts.
//
// What published checkpoints carry beyond the table's tensors:
//   - Block-scaled FP8 weights (DeepSeek-V3, Kimi-K2; see fp8.h): an FP8 source
//     `X` is planned together with its companion scale -- `X_scale_inv`, or
//     `X_scale` in compressed-tensors' float-quantized checkpoints
//     (LoadOptions::fp8_scale_suffix) -- which is never a tensor of its own (no
//     rule, never unexpected), and both are read only where the source is, so
//     a rank reads only its own experts' FP8 bytes and scales. The weight is
//     widened block by block straight into its place in the target (the
//     target's dtype; BF16 when the caller names no dtype), never through an
//     upcast copy of the file. An FP8 source without its scale is missing (the
//     scale's name); a scale of the wrong shape is mismatched.
//     A target the caller expects in an FP8 dtype (a frozen base's routed
//     experts) is kept as stored instead: its bytes are read as they are, and
//     the expected `<target>_scale_inv` (float32) is built by the same rule
//     from the sources' scales -- experts stacked, gate and up scales joined
//     -- which needs every source but the last of a concatenation to fill
//     whole blocks (DeepSeek-V3's moe_intermediate_size 2048 does).
//   - Pack-quantized int4 weights (compressed-tensors: Kimi-K2-Thinking's
//     routed experts; see compressed_tensors.h), read with LoadOptions::int4
//     set: an on-disk `X.weight_packed` is the source `X.weight` the table
//     names, and `X.weight_scale`, `X.weight_shape` and (asymmetric schemes)
//     `X.weight_zero_point` are its companions, attached to it like an FP8
//     scale: missing ones are missing by name, ill-shaped ones mismatched, and
//     all are read only where the source is. The `_shape` companions (two
//     integers each) are read while planning, as they hold the logical column
//     count that the packed width only rounds up.
//     A target expected in a floating dtype gets the values compressed-tensors'
//     decompression gives (rounded to the scale's dtype, then converted),
//     each source dequantized straight into its place; with `expected` empty,
//     in dequantized_dtype.
//     A target expected as uint8 (at::kByte) is kept packed: [E, rows,
//     ceil(cols / 8) * 4], each row the bytes of its int32 words as stored
//     (element c is nibble c, low nibble first, holding q + 8), read with
//     pread(). Its companions are further targets the caller expects:
//     `<target>_scale`, bfloat16 [E, rows, ceil(cols / group_size)], the
//     scales as stored (a BF16 scale is required), and, asymmetric only,
//     `<target>_zero_point`, int8 [E, rows, ceil(cols / group_size)], the zero
//     points unpacked to one signed value per (row, group). Only the routed
//     experts' rules (experts merged, then gate and up joined along the rows)
//     can keep int4; another rule on such a target is mismatched.
//   - Multi-token-prediction modules stored as one more decoder layer
//     (DeepSeek-V3's model.layers.61, GLM-4.5's model.layers.92): with
//     skip_layers_from set, such keys are skipped by name before matching.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "checkpoint/compressed_tensors.h"
#include "checkpoint/fp8.h"
#include "checkpoint/mapping_table.h"

namespace moefit::checkpoint {

// What the model expects a runtime tensor to look like.
struct ExpectedTensor {
  std::vector<int64_t> shape;
  // The loaded tensor is converted to this dtype (like transformers' torch_dtype).
  at::ScalarType dtype = at::kFloat;
};

struct LoadOptions {
  // This rank's experts: global indices [first_expert, first_expert + num_experts).
  // Expert targets get dim 0 of size num_experts, local index = global - first_expert.
  int64_t first_expert = 0;
  // nullopt: every expert the checkpoint has (from 0 up to its largest index).
  std::optional<int64_t> num_experts;
  // Threads of the task arena that reads and converts; 0: oneTBB's default.
  int num_threads = 0;
  // Targets being converted at once, which bounds the extra memory; 0: num_threads.
  int max_targets_in_flight = 0;
  // Runtime name -> shape and dtype. Empty: load every target the files give, in
  // their stored dtype (dequantized_dtype for FP8 and int4 sources), and report
  // only incomplete targets as missing. Non-empty:
  // load exactly these; checkpoint tensors that feed nothing here are unexpected.
  // A target expected in an FP8 dtype is kept in FP8 (see above) and may be
  // joined by its `<target>_scale_inv`, float32 of the block grid's shape; one
  // expected as uint8 over int4 sources is kept packed, joined by its
  // `<target>_scale` (bfloat16) and, asymmetric, `<target>_zero_point` (int8).
  std::map<std::string, ExpectedTensor> expected;
  // Block [rows, columns] of block-scaled FP8 sources (config.json's
  // quantization_config.weight_block_size, or a compressed-tensors scheme's
  // block_structure): every FP8 source `X` [out, in] needs its scale
  // `X<fp8_scale_suffix>` [ceil(out / fp8_block[0]), ceil(in / fp8_block[1])].
  std::array<int64_t, 2> fp8_block = kDefaultFp8Block;
  // How an FP8 weight's scale is named: `X_scale_inv` (DeepSeek-V3, Kimi-K2) or
  // `X_scale` (compressed-tensors' float-quantized format, kScaleSuffix). The
  // same value either way: the weight is fp8 * scale.
  std::string fp8_scale_suffix = std::string(kScaleInvSuffix);
  // Set for compressed-tensors pack-quantized checkpoints: `X.weight_packed`
  // sources with their companions (see above), in groups of group_size
  // columns, with zero points unless symmetric. nullopt: such keys match no
  // rule and are unexpected.
  std::optional<PackedInt4Format> int4;
  // Dtype of targets built from FP8 or int4 sources when `expected` names none.
  at::ScalarType dequantized_dtype = at::kBFloat16;
  // When set, on-disk keys `model.layers.N.<anything>` with N >= this are
  // skipped by name: never matched, never read, listed in LoadReport::skipped.
  // The caller sets it to num_hidden_layers when config.json has
  // num_nextn_predict_layers > 0, whose modules follow the decoder layers.
  std::optional<int64_t> skip_layers_from;
  // With skip_layers_from: only layers below this are skipped (the MTP layers
  // are [num_hidden_layers, num_hidden_layers + num_nextn_predict_layers), so a
  // model configured with fewer layers than its checkpoint still reports the
  // other layers as unexpected). nullopt: every layer from skip_layers_from on.
  std::optional<int64_t> skip_layers_until;
  // Runtime name -> the tensor to fill in place instead of a new one: a model
  // passes its own parameters, so that loading needs no second copy of the
  // weights to copy over. Each must be a contiguous CPU tensor of the target's
  // shape and dtype (it may require grad: it is written through a detached
  // alias); the caller keeps destinations apart (no two sharing memory).
  // Destinations of a target this load does not produce, or of the wrong shape,
  // dtype, device or layout, fail with one InvalidArgument naming all of them,
  // after the report's checks and before anything is read. The returned map
  // holds these same tensors; targets without one get a new tensor. A tensor
  // on the GPU is loaded to the host without a destination and copied once.
  std::map<std::string, at::Tensor> destinations;
};

// What LoadCheckpoint found, in the spirit of transformers' loading info. Names
// are sorted in natural order.
struct LoadReport {
  // On-disk tensors a wanted target needs but the files lack (or, when no
  // source exists at all, the target's runtime name).
  std::vector<std::string> missing;
  // On-disk tensors that match no rule and no ignore pattern, or feed a target
  // the model does not expect.
  std::vector<std::string> unexpected;
  // "<runtime name>: checkpoint gives [..], model expects [..]" (or why the
  // rule could not be applied to the stored shapes).
  std::vector<std::string> mismatched;
  // On-disk tensors matched by the table's ignore patterns (with their
  // companions: FP8 scales, int4 scales, shapes and zero points).
  std::vector<std::string> ignored;
  // On-disk tensors of layers at or past LoadOptions::skip_layers_from, unread.
  std::vector<std::string> skipped;

  int64_t num_files_opened = 0;
  // Source tensors (or packed slices) and their companions (FP8 and int4
  // scales, int4 shapes and zero points) read.
  int64_t num_tensors_read = 0;
  uint64_t num_bytes_read = 0;     // bytes of tensor data read from the files
  int64_t num_global_experts = 0;  // largest expert index seen + 1 (0 if none)
  double seconds = 0;

  bool ok() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
  // The problems as one message (at most a few names per kind, then a count).
  std::string ProblemSummary() const;
};

// Loads the checkpoint in `dir` with `family`'s compiled-in table (see above).
// Errors: NotFound for an unknown family or an empty directory; InvalidArgument
// for a negative expert slice, a non-positive fp8_block or int4 group size, an
// empty fp8_scale_suffix, and naming every
// problem of the report (which is filled in either way when given);
// I/O and format errors naming the file and tensor.
absl::StatusOr<std::map<std::string, at::Tensor>> LoadCheckpoint(const std::filesystem::path& dir,
                                                                 std::string_view family,
                                                                 const LoadOptions& options = {},
                                                                 LoadReport* report = nullptr);

// Same with an explicit table.
absl::StatusOr<std::map<std::string, at::Tensor>> LoadCheckpoint(const std::filesystem::path& dir,
                                                                 const MappingTable& table,
                                                                 const LoadOptions& options = {},
                                                                 LoadReport* report = nullptr);

// Whether the checkpoint in `dir` stores `family`'s routed experts
// block-scaled FP8, as a target expected in an FP8 dtype keeps them: its
// first per-expert weight (the first key, in natural order, of a rule that
// merges experts) is F8_E4M3 with a `_scale_inv` or `_scale` beside it. false
// without per-expert weights, or where they were converted to another dtype (a
// bfloat16 conversion may keep config.json's quantization_config). Reads the
// index or the files' headers, as LoadCheckpoint does, and no tensor data.
absl::StatusOr<bool> ExpertsStoredAsFp8(const std::filesystem::path& dir, std::string_view family);

// Whether the checkpoint in `dir` stores `family`'s routed experts
// pack-quantized int4, as a target expected as uint8 keeps them: its first
// per-expert weight is an I32 `X.weight_packed` with an `X.weight_scale` beside
// it. false otherwise (no per-expert weights, or stored in a float dtype).
// Reads headers only, as ExpertsStoredAsFp8.
absl::StatusOr<bool> ExpertsStoredAsInt4(const std::filesystem::path& dir, std::string_view family);

// The dtype most of the checkpoint's weight matrices are stored in: over its
// 2-D floating `.weight` tensors other than routers (`mlp.gate.weight`, often
// kept wider), the dtype that holds the most elements (FP8 included as
// float8_e4m3fn). Packed int4 weights (`.weight_packed`, integers) are not
// among them: an int4 checkpoint's answer is its dense weights' dtype
// (bfloat16 for Kimi-K2-Thinking). Finds the files as LoadCheckpoint does (the index, or every
// shard's header) and reads no tensor data. InvalidArgument, naming `dir`,
// when there is no such tensor.
absl::StatusOr<at::ScalarType> StoredWeightDtype(const std::filesystem::path& dir);

}  // namespace moefit::checkpoint
