// LoadCheckpoint: plan from headers, check, then read and convert on a task graph
// (see weight_loader.h).
//
// Three stages, each complete before the next:
//   1. Keys: the index (or every shard header) gives every on-disk name; each is
//      matched to the table once, grouping sources by the target they feed.
//      Keys of skipped layers (MTP) drop out here, by name; companions (FP8
//      scales; int4 scales, shapes and zero points) are attached to their
//      weight instead of being matched, and a packed int4 `X.weight_packed` is
//      matched as the `X.weight` it stands for.
//   2. Plan: for each wanted target, the sources this rank needs are resolved
//      (opening only the shards that hold them) and the rule runs on meta tensors
//      of the stored shapes (an int4 source's: its logical shape, from its
//      `_shape` companion, the only data read here), which yields the target's
//      shape or the reason the stored shapes do not fit. Every problem goes into
//      the report; any problem stops the load here, before the sources' data is
//      read.
//   3. Convert: a tbb::flow function_node with bounded concurrency takes targets
//      one by one and builds each into its own tensor (the caller's destination
//      when it gave one, checked against the plan before this stage starts) as
//      soon as its sources are read. The common rules (merge the experts, then
//      concatenate gate and up; or a plain rename) place every source directly
//      at its spot in the target: pread() from the shard when no dtype
//      conversion is needed, else a converting copy from the read-only
//      mapping. Any other rule runs the reference ops on mapping views
//      (madvise(WILLNEED) first so the kernel reads ahead) and copies the
//      result. A block-scaled FP8 source is widened from its mapping straight
//      into its spot (DequantizeBlockFp8Into); for the other rules it is
//      widened to an fp32 copy of that one source first. A packed int4 source
//      is likewise dequantized from its mapping into its spot, or, kept packed,
//      pread() as bytes like any other source; its zero points are unpacked
//      into their own target's spot.
#include "checkpoint/weight_loader.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <tbb/blocked_range.h>
#include <tbb/flow_graph.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/compressed_tensors.h"
#include "checkpoint/conversion_ops.h"
#include "checkpoint/fp8.h"
#include "checkpoint/internal/shapes.h"
#include "checkpoint/internal/strings.h"
#include "checkpoint/natural_order.h"
#include "checkpoint/safetensors_index.h"
#include "checkpoint/tensor_io.h"
#include "proto/status_macros.h"

namespace moefit::checkpoint {
namespace {

using internal::AsAbsl;
using Kind = ConversionOp::Kind;

constexpr size_t kMaxNamesInSummary = 8;
// Contiguous copies larger than this are split over threads.
constexpr size_t kParallelCopyBlockBytes = size_t{16} << 20;

using internal::ShapeString;

// A shard: its validated mapping, plus a descriptor for pread() of its data.
struct OpenedFile {
  SafetensorsFile file;
  int fd = -1;
  uint64_t data_offset = 0;  // file offset of the data section

  explicit OpenedFile(SafetensorsFile f) : file(std::move(f)) {}
  OpenedFile(const OpenedFile&) = delete;
  OpenedFile& operator=(const OpenedFile&) = delete;
  ~OpenedFile() {
    if (fd >= 0) ::close(fd);
  }
};

// The shards of a checkpoint directory and the name of every tensor in them.
// With an index, shards are opened only when one of their tensors is needed.
class CheckpointDir {
 public:
  static absl::StatusOr<CheckpointDir> Scan(const std::filesystem::path& dir) {
    CheckpointDir out;
    out.dir_ = dir;
    std::error_code ec;
    if (!std::filesystem::is_directory(dir, ec)) {
      return absl::NotFoundError(absl::StrCat(dir.string(), ": not a directory"));
    }
    const std::filesystem::path index_path = dir / std::string(kIndexFileName);
    if (std::filesystem::exists(index_path, ec)) {
      MOEFIT_ASSIGN_OR_RETURN(ShardedIndex index, ReadShardedIndex(index_path));
      std::map<std::string, int> file_idx;
      for (const auto& [name, file] : index.weight_map) {
        auto [it, inserted] = file_idx.try_emplace(file, static_cast<int>(out.file_names_.size()));
        if (inserted) out.file_names_.push_back(file);
        out.keys_.emplace(name, it->second);
      }
      out.files_.resize(out.file_names_.size());
      return out;
    }
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      if (entry.path().extension() == ".safetensors") {
        out.file_names_.push_back(entry.path().filename().string());
      }
    }
    if (ec) return absl::NotFoundError(absl::StrCat(dir.string(), ": ", ec.message()));
    if (out.file_names_.empty()) {
      return absl::NotFoundError(
          absl::StrCat(dir.string(), ": no ", AsAbsl(kIndexFileName), " and no *.safetensors"));
    }
    std::sort(out.file_names_.begin(), out.file_names_.end(), NaturalLessCompare{});
    out.files_.resize(out.file_names_.size());
    for (int file_idx = 0; file_idx < static_cast<int>(out.file_names_.size()); ++file_idx) {
      MOEFIT_ASSIGN_OR_RETURN(const OpenedFile* file, out.Open(file_idx));
      for (const TensorInfo& info : file->file.tensors()) {
        auto [it, inserted] = out.keys_.emplace(info.name, file_idx);
        if (!inserted) {
          return absl::InvalidArgumentError(
              absl::StrCat(dir.string(), ": tensor \"", info.name, "\" is in both ",
                           out.file_names_[it->second], " and ", out.file_names_[file_idx]));
        }
      }
    }
    return out;
  }

  // Every on-disk name -> index of its shard, in natural order.
  const std::map<std::string, int, NaturalLessCompare>& keys() const { return keys_; }

  // The shard holding `name` (opened if needed) and the tensor's header entry.
  absl::StatusOr<std::pair<const OpenedFile*, const TensorInfo*>> Resolve(const std::string& name) {
    const auto it = keys_.find(name);
    if (it == keys_.end()) {
      return absl::NotFoundError(absl::StrCat(dir_.string(), ": no tensor \"", name, "\""));
    }
    MOEFIT_ASSIGN_OR_RETURN(const OpenedFile* file, Open(it->second));
    const TensorInfo* info = file->file.Find(name);
    if (info == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat((dir_ / std::string(kIndexFileName)).string(), ": maps tensor \"", name,
                       "\" to ", file_names_[it->second], ", which does not hold it"));
    }
    return std::make_pair(file, info);
  }

  int num_opened() const {
    return static_cast<int>(
        std::count_if(files_.begin(), files_.end(), [](const auto& f) { return f != nullptr; }));
  }

 private:
  absl::StatusOr<const OpenedFile*> Open(int file_idx) {
    std::unique_ptr<OpenedFile>& slot = files_[file_idx];
    if (!slot) {
      const std::filesystem::path path = dir_ / file_names_[file_idx];
      MOEFIT_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(path));
      auto opened = std::make_unique<OpenedFile>(std::move(file));
      opened->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (opened->fd < 0) {
        return absl::ErrnoToStatus(errno, absl::StrCat(path.string(), ": cannot open"));
      }
      struct stat st {};
      if (::fstat(opened->fd, &st) != 0) {
        return absl::ErrnoToStatus(errno, absl::StrCat(path.string(), ": cannot stat"));
      }
      // A safetensors file is 8 + header + data bytes, data last.
      opened->data_offset = static_cast<uint64_t>(st.st_size) - opened->file.data_size();
      slot = std::move(opened);
    }
    return slot.get();
  }

  std::filesystem::path dir_;
  std::vector<std::string> file_names_;
  std::vector<std::unique_ptr<OpenedFile>> files_;
  std::map<std::string, int, NaturalLessCompare> keys_;
};

struct SourceRef {
  const OpenedFile* file = nullptr;
  const TensorInfo* info = nullptr;
  // The source's scale: a block-scaled FP8 source's `_scale_inv` (or `_scale`),
  // a packed int4 source's `_scale` (its shard may differ).
  const OpenedFile* scale_file = nullptr;
  const TensorInfo* scale_info = nullptr;
  // A packed int4 source (`X.weight_packed`): its other companions, and its
  // logical [rows, cols] once planning has read `X.weight_shape`.
  bool int4 = false;
  const OpenedFile* shape_file = nullptr;
  const TensorInfo* shape_info = nullptr;
  const OpenedFile* zero_file = nullptr;  // asymmetric schemes only
  const TensorInfo* zero_info = nullptr;
  std::array<int64_t, 2> logical = {0, 0};

  bool is_fp8() const { return scale_info != nullptr && !int4; }
};

// What a target holds: its sources' values, or a companion of another
// target kept in its stored format, built by that target's rule from the
// sources' companions.
enum class Part {
  kValues,
  kFp8Scales,       // `<target>_scale_inv` of a target kept in FP8
  kInt4Scales,      // `<target>_scale` of a target kept packed int4
  kInt4ZeroPoints,  // `<target>_zero_point` of one, unpacked to int8
};

// Runtime name suffixes of the companion targets.
struct CompanionTarget {
  std::string_view suffix;
  Part part;
};
constexpr CompanionTarget kCompanionTargets[] = {
    {kScaleInvSuffix, Part::kFp8Scales},
    {kScaleSuffix, Part::kInt4Scales},
    {kZeroPointSuffix, Part::kInt4ZeroPoints},
};

// One runtime tensor and everything needed to produce it.
struct TargetPlan {
  const MappingRule* rule = nullptr;
  std::string name;
  std::vector<int64_t> numbers;  // the target pattern's `*` values
  // Per source pattern: expert index -> on-disk name (index 0 for non-merge rules).
  std::vector<std::map<int64_t, std::string>> keys;

  // Filled by planning.
  std::vector<std::vector<SourceRef>> inputs;  // [source pattern][local expert]
  int64_t first_row = 0;                       // packed sources: this rank's rows
  int64_t num_rows = -1;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  // A companion target (FP8 scale grid, int4 scales or zero points) is the
  // same rule applied to the companions of `weight`'s sources (`keys` are
  // the companions' names).
  Part part = Part::kValues;
  std::string weight;

  bool companion() const { return part != Part::kValues; }
};

// Copies `src` into `dst` (same shape), converting the dtype if they differ;
// contiguous same-dtype copies are plain memcpys, split over threads when large.
void CopyInto(at::Tensor dst, const at::Tensor& src) {
  if (dst.scalar_type() != src.scalar_type() || !dst.is_contiguous() || !src.is_contiguous()) {
    dst.copy_(src);
    return;
  }
  const size_t num_bytes = dst.nbytes();
  auto* out = static_cast<std::byte*>(dst.data_ptr());
  const auto* in = static_cast<const std::byte*>(src.const_data_ptr());
  if (num_bytes <= kParallelCopyBlockBytes) {
    std::memcpy(out, in, num_bytes);
    return;
  }
  const size_t num_blocks = (num_bytes + kParallelCopyBlockBytes - 1) / kParallelCopyBlockBytes;
  tbb::parallel_for(size_t{0}, num_blocks, [&](size_t block_idx) {
    const size_t begin = block_idx * kParallelCopyBlockBytes;
    std::memcpy(out + begin, in + begin, std::min(kParallelCopyBlockBytes, num_bytes - begin));
  });
}

// madvise over the whole pages holding `bytes`.
void Advise(std::span<const std::byte> bytes, int advice) {
  if (bytes.empty()) return;
  static const uintptr_t kPage = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(bytes.data()) & ~(kPage - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(bytes.data()) + bytes.size();
  ::madvise(reinterpret_cast<void*>(begin), end - begin, advice);
}

// Asks the kernel to read a tensor's pages ahead of the copy that touches them.
void Prefetch(std::span<const std::byte> bytes) { Advise(bytes, MADV_WILLNEED); }

// Unmaps a converted source's pages from this process (they stay in the page
// cache; a later touch refaults them), so the process's resident memory grows
// by the converted targets, not by the checkpoint's mapped files too.
void Release(std::span<const std::byte> bytes) { Advise(bytes, MADV_DONTNEED); }

// Rules done as one copy per source: a rename, a merge of experts, or a merge
// followed by a concatenate of the sources on a non-expert dim.
bool HasFusedPath(const MappingRule& rule) {
  const std::vector<ConversionOp>& ops = rule.ops;
  if (ops.empty()) return true;
  if (ops[0].kind != Kind::kMergeModulelist || ops[0].dim != 0) return false;
  if (ops.size() == 1) return true;
  return ops.size() == 2 && ops[1].kind == Kind::kConcatenate && ops[1].dim >= 1;
}

class Loader {
 public:
  Loader(const std::filesystem::path& dir, const MappingTable& table, const LoadOptions& options,
         LoadReport& report)
      : dir_(dir), table_(table), options_(options), report_(report) {}

  absl::StatusOr<std::map<std::string, at::Tensor>> Run() {
    MOEFIT_ASSIGN_OR_RETURN(files_, CheckpointDir::Scan(dir_));
    MOEFIT_RETURN_IF_ERROR(MatchKeys());
    MOEFIT_RETURN_IF_ERROR(SelectTargets());
    // Weights first: a companion target is planned only where its weight
    // planned well, and takes its sources' logical shapes from that plan.
    for (TargetPlan* plan : wanted_) {
      if (!plan->companion()) MOEFIT_RETURN_IF_ERROR(Plan(*plan));
    }
    for (TargetPlan* plan : wanted_) {
      if (plan->companion()) MOEFIT_RETURN_IF_ERROR(Plan(*plan));
    }
    report_.num_files_opened = files_->num_opened();
    // The int4 sources' shapes, read while planning.
    report_.num_bytes_read = bytes_read_.load();
    report_.num_tensors_read = tensors_read_.load();
    SortNames(report_.missing);
    SortNames(report_.unexpected);
    SortNames(report_.mismatched);
    SortNames(report_.ignored);
    SortNames(report_.skipped);
    if (!report_.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot load ", dir_.string(), " as ", table_.family, ": ", report_.ProblemSummary()));
    }
    MOEFIT_RETURN_IF_ERROR(CheckDestinations());
    return Convert();
  }

 private:
  static void SortNames(std::vector<std::string>& names) {
    std::sort(names.begin(), names.end(), NaturalLessCompare{});
  }

  // Stage 1: every on-disk name to its target (or ignored / unexpected).
  absl::Status MatchKeys() {
    const auto& keys = files_->keys();
    for (const auto& [key, file_idx] : keys) {
      if (IsSkippedLayer(key)) {
        report_.skipped.push_back(key);
        continue;
      }
      // A companion goes wherever its weight goes; one of nothing feeds nothing.
      if (const std::optional<bool> attached = AttachCompanion(key)) {
        if (!*attached) report_.unexpected.push_back(key);
        continue;
      }
      // The table names `X.weight` where the files hold `X.weight_packed`.
      std::string name = key;
      if (const std::optional<std::string> base = PackedBase(key)) {
        if (keys.contains(*base)) {
          report_.mismatched.push_back(
              absl::StrCat(key, ": stored beside ", *base, ", both giving the same weight"));
          continue;
        }
        name = *base;
      }
      bool matched = false;
      for (const MappingRule& rule : table_.rules) {
        for (size_t pattern_idx = 0; pattern_idx < rule.sources.size(); ++pattern_idx) {
          std::optional<std::vector<int64_t>> numbers = rule.sources[pattern_idx].Match(name);
          if (!numbers) continue;
          int64_t expert_idx = 0;
          if (rule.merges_experts()) {
            expert_idx = numbers->back();
            numbers->pop_back();
          }
          const std::string target = rule.target.Fill(*numbers);
          auto [it, inserted] = targets_.try_emplace(target);
          TargetPlan& plan = it->second;
          if (inserted) {
            plan.rule = &rule;
            plan.name = target;
            plan.numbers = *numbers;
            plan.keys.resize(rule.sources.size());
          } else if (plan.rule != &rule) {
            return absl::InvalidArgumentError(
                absl::StrCat(table_.file, ":", rule.line, ": rule maps \"", key, "\" to \"", target,
                             "\", which the rule at line ", plan.rule->line, " also produces"));
          }
          plan.keys[pattern_idx][expert_idx] = key;
          report_.num_global_experts =
              std::max(report_.num_global_experts, rule.merges_experts() ? expert_idx + 1 : 0);
          matched = true;
          break;
        }
        if (matched) break;
      }
      if (matched) continue;
      const bool ignored =
          std::any_of(table_.ignore.begin(), table_.ignore.end(),
                      [&](const KeyPattern& p) { return p.Match(name).has_value(); });
      (ignored ? report_.ignored : report_.unexpected).push_back(key);
      if (ignored) {
        for (const std::string& companion : CompanionKeys(key))
          report_.ignored.push_back(companion);
      }
    }
    return absl::OkStatus();
  }

  // `X.weight` for a packed int4 key `X.weight_packed` (with LoadOptions::int4
  // set), else nullopt.
  std::optional<std::string> PackedBase(std::string_view key) const {
    if (!options_.int4 || !key.ends_with(kPackedSuffix)) return std::nullopt;
    return std::string(key.substr(0, key.size() - kPackedSuffix.size()));
  }

  // The int4 companion suffixes of the configured scheme.
  std::vector<std::string_view> Int4CompanionSuffixes() const {
    std::vector<std::string_view> suffixes = {kScaleSuffix, kShapeSuffix};
    if (options_.int4 && !options_.int4->symmetric) suffixes.push_back(kZeroPointSuffix);
    return suffixes;
  }

  // For a key named like a companion: whether its weight is there (true, and
  // an FP8 scale is noted in scales_) or not (false). nullopt for other keys.
  std::optional<bool> AttachCompanion(const std::string& key) {
    const auto& keys = files_->keys();
    if (options_.int4) {
      // Zero points of a symmetric scheme are no companion: the scheme has none.
      for (std::string_view suffix : {kScaleSuffix, kShapeSuffix, kZeroPointSuffix}) {
        if (!key.ends_with(suffix)) continue;
        const std::string base = key.substr(0, key.size() - suffix.size());
        if (!keys.contains(absl::StrCat(base, AsAbsl(kPackedSuffix)))) break;
        return suffix != kZeroPointSuffix || !options_.int4->symmetric;
      }
    }
    const std::string& suffix = options_.fp8_scale_suffix;
    if (!key.ends_with(suffix)) return std::nullopt;
    const std::string weight = key.substr(0, key.size() - suffix.size());
    if (!keys.contains(weight)) return false;
    scales_.emplace(weight, key);
    return true;
  }

  // The companions present beside the source key `key`.
  std::vector<std::string> CompanionKeys(const std::string& key) const {
    const auto& keys = files_->keys();
    std::vector<std::string> out;
    if (const std::optional<std::string> base = PackedBase(key)) {
      for (std::string_view suffix : Int4CompanionSuffixes()) {
        std::string companion = absl::StrCat(*base, AsAbsl(suffix));
        if (keys.contains(companion)) out.push_back(std::move(companion));
      }
    } else if (std::string scale = key + options_.fp8_scale_suffix; keys.contains(scale)) {
      out.push_back(std::move(scale));
    }
    return out;
  }

  // `model.layers.N.<anything>` with skip_layers_from <= N < skip_layers_until.
  bool IsSkippedLayer(std::string_view key) const {
    constexpr std::string_view kPrefix = "model.layers.";
    if (!options_.skip_layers_from || !key.starts_with(kPrefix)) return false;
    const size_t dot = key.find('.', kPrefix.size());
    if (dot == std::string_view::npos || dot == kPrefix.size()) return false;
    int64_t layer_idx = 0;
    for (const char c : key.substr(kPrefix.size(), dot - kPrefix.size())) {
      if (c < '0' || c > '9') return false;
      // Absurdly long numbers saturate rather than overflow.
      layer_idx = std::min<int64_t>(layer_idx * 10 + (c - '0'), int64_t{1} << 40);
    }
    return layer_idx >= *options_.skip_layers_from &&
           (!options_.skip_layers_until || layer_idx < *options_.skip_layers_until);
  }

  // What a target the files do not produce at all would have been read from.
  void ReportMissingTarget(const std::string& name) {
    for (const MappingRule& rule : table_.rules) {
      std::optional<std::vector<int64_t>> numbers = rule.target.Match(name);
      if (!numbers) continue;
      if (!rule.merges_experts()) {
        for (const KeyPattern& source : rule.sources)
          report_.missing.push_back(source.Fill(*numbers));
        return;
      }
      if (options_.num_experts) {
        for (const KeyPattern& source : rule.sources) {
          for (int64_t e = 0; e < *options_.num_experts; ++e) {
            std::vector<int64_t> with_expert = *numbers;
            with_expert.push_back(options_.first_expert + e);
            report_.missing.push_back(source.Fill(with_expert));
          }
        }
        return;
      }
      break;
    }
    report_.missing.push_back(name);
  }

  // Which targets to produce; expected names the files cannot give are missing,
  // targets the model does not want are unexpected.
  absl::Status SelectTargets() {
    if (options_.expected.empty()) {
      for (auto& [name, plan] : targets_) wanted_.push_back(&plan);
      return absl::OkStatus();
    }
    for (const auto& [name, expected] : options_.expected) {
      auto it = targets_.find(name);
      if (it == targets_.end()) it = AddCompanionTarget(name);
      if (it != targets_.end()) {
        wanted_.push_back(&it->second);
        continue;
      }
      const auto [weight, part] = CompanionTargetOf(name);
      if (part == Part::kValues || !targets_.contains(weight)) {
        ReportMissingTarget(name);
      } else if (part == Part::kFp8Scales) {
        report_.mismatched.push_back(absl::StrCat(
            name, ": a scale grid is loaded only beside a target expected in an FP8 dtype, and ",
            weight, " is not"));
      } else if (part == Part::kInt4ZeroPoints && options_.int4 && options_.int4->symmetric) {
        report_.mismatched.push_back(absl::StrCat(name, ": the int4 scheme is symmetric, so ",
                                                  weight, " has no zero points"));
      } else {
        report_.mismatched.push_back(absl::StrCat(
            name,
            ": int4 scales and zero points are loaded only beside a target kept packed "
            "(expected as uint8, over pack-quantized int4 sources), and ",
            weight, " is not"));
      }
    }
    for (const auto& [name, plan] : targets_) {
      if (options_.expected.contains(name)) continue;
      for (const auto& experts : plan.keys) {
        for (const auto& [expert_idx, key] : experts) report_.unexpected.push_back(key);
      }
    }
    return absl::OkStatus();
  }

  // The target a companion target's name belongs to and what the companion
  // is: `X_scale_inv` -> (X, FP8 scales), `X_scale` -> (X, int4 scales),
  // `X_zero_point` -> (X, int4 zero points); ("", kValues) for other names.
  static std::pair<std::string, Part> CompanionTargetOf(const std::string& name) {
    for (const CompanionTarget& companion : kCompanionTargets) {
      if (name.ends_with(companion.suffix)) {
        return {name.substr(0, name.size() - companion.suffix.size()), companion.part};
      }
    }
    return {"", Part::kValues};
  }

  // Whether the model keeps target X in its stored format with `part` beside
  // it: FP8 scales beside an FP8 target, int4 scales (and, asymmetric, zero
  // points) beside a target kept packed int4.
  bool KeepsCompanion(const ExpectedTensor& weight, Part part) const {
    switch (part) {
      case Part::kFp8Scales:
        return IsFp8Dtype(weight.dtype);
      case Part::kInt4Scales:
        return options_.int4 && weight.dtype == at::kByte;
      case Part::kInt4ZeroPoints:
        return options_.int4 && !options_.int4->symmetric && weight.dtype == at::kByte;
      case Part::kValues:
        break;
    }
    return false;
  }

  // A companion target (`X_scale_inv`, `X_scale`, `X_zero_point`) where the
  // model keeps target X in its stored format: a target of X's rule over the
  // companions of X's sources. targets_.end() for any other name.
  std::map<std::string, TargetPlan, NaturalLessCompare>::iterator AddCompanionTarget(
      const std::string& name) {
    const auto [weight, part] = CompanionTargetOf(name);
    if (part == Part::kValues) return targets_.end();
    const auto weight_plan = targets_.find(weight);
    const auto expected = options_.expected.find(weight);
    if (weight_plan == targets_.end() || weight_plan->second.companion() ||
        expected == options_.expected.end() || !KeepsCompanion(expected->second, part)) {
      return targets_.end();
    }
    TargetPlan plan = weight_plan->second;
    plan.name = name;
    plan.part = part;
    plan.weight = weight;
    for (auto& experts : plan.keys) {
      for (auto& [expert_idx, key] : experts) key = CompanionKey(key, part);
    }
    return targets_.emplace(name, std::move(plan)).first;
  }

  // The on-disk name of source `key`'s companion `part`.
  std::string CompanionKey(const std::string& key, Part part) const {
    if (part == Part::kFp8Scales) return key + options_.fp8_scale_suffix;
    const std::string base = PackedBase(key).value_or(key);
    return absl::StrCat(base, AsAbsl(part == Part::kInt4Scales ? kScaleSuffix : kZeroPointSuffix));
  }

  // Stage 2 for one target: its sources on this rank and its shape.
  absl::Status Plan(TargetPlan& plan) {
    const MappingRule& rule = *plan.rule;
    if (plan.companion() && targets_.at(plan.weight).shape.empty()) {
      return absl::OkStatus();  // its weight's problem is named
    }
    plan.inputs.assign(rule.sources.size(), {});
    bool complete = true;
    auto add_input = [&](size_t pattern_idx, const std::string& key) -> absl::Status {
      MOEFIT_ASSIGN_OR_RETURN(auto resolved, files_->Resolve(key));
      SourceRef ref{.file = resolved.first, .info = resolved.second};
      if (plan.companion()) {
        plan.inputs[pattern_idx].push_back(ref);
        return absl::OkStatus();
      }
      if (const auto it = scales_.find(key); it != scales_.end()) {
        MOEFIT_ASSIGN_OR_RETURN(auto scale, files_->Resolve(it->second));
        ref.scale_file = scale.first;
        ref.scale_info = scale.second;
      }
      if (const std::optional<std::string> base = PackedBase(key)) {
        // Missing companions stay null here; CheckInt4 names them.
        ref.int4 = true;
        auto attach = [&](std::string_view suffix, const OpenedFile*& file,
                          const TensorInfo*& info) -> absl::Status {
          const std::string companion = absl::StrCat(*base, AsAbsl(suffix));
          if (!files_->keys().contains(companion)) return absl::OkStatus();
          MOEFIT_ASSIGN_OR_RETURN(auto resolved_companion, files_->Resolve(companion));
          file = resolved_companion.first;
          info = resolved_companion.second;
          return absl::OkStatus();
        };
        MOEFIT_RETURN_IF_ERROR(attach(kScaleSuffix, ref.scale_file, ref.scale_info));
        MOEFIT_RETURN_IF_ERROR(attach(kShapeSuffix, ref.shape_file, ref.shape_info));
        if (!options_.int4->symmetric) {
          MOEFIT_RETURN_IF_ERROR(attach(kZeroPointSuffix, ref.zero_file, ref.zero_info));
        }
      }
      plan.inputs[pattern_idx].push_back(ref);
      return absl::OkStatus();
    };
    if (rule.merges_experts()) {
      int64_t num_global = 0;
      for (const auto& experts : plan.keys) {
        if (!experts.empty()) num_global = std::max(num_global, experts.rbegin()->first + 1);
      }
      const int64_t first = options_.first_expert;
      const int64_t num = options_.num_experts.value_or(std::max<int64_t>(num_global - first, 0));
      for (size_t pattern_idx = 0; pattern_idx < rule.sources.size(); ++pattern_idx) {
        for (int64_t expert_idx = first; expert_idx < first + num; ++expert_idx) {
          const auto it = plan.keys[pattern_idx].find(expert_idx);
          // A companion plan's gaps are its weight plan's to report.
          if (it == plan.keys[pattern_idx].end() ||
              (plan.companion() && !files_->keys().contains(it->second))) {
            if (!plan.companion()) {
              std::vector<int64_t> numbers = plan.numbers;
              numbers.push_back(expert_idx);
              report_.missing.push_back(rule.sources[pattern_idx].Fill(numbers));
            }
            complete = false;
            continue;
          }
          MOEFIT_RETURN_IF_ERROR(add_input(pattern_idx, it->second));
        }
      }
    } else {
      for (size_t pattern_idx = 0; pattern_idx < rule.sources.size(); ++pattern_idx) {
        const auto it = plan.keys[pattern_idx].find(0);
        if (it == plan.keys[pattern_idx].end() ||
            (plan.companion() && !files_->keys().contains(it->second))) {
          if (!plan.companion()) {
            report_.missing.push_back(rule.sources[pattern_idx].Fill(plan.numbers));
          }
          complete = false;
          continue;
        }
        MOEFIT_RETURN_IF_ERROR(add_input(pattern_idx, it->second));
      }
    }
    for (auto& refs : plan.inputs) {
      for (SourceRef& ref : refs) {
        complete &= CheckFp8(plan, ref);
        complete &= CheckInt4(plan, ref);
      }
    }
    if (complete && KeptFp8(plan)) complete = CheckKeptFp8(plan);
    if (complete && KeptInt4(plan)) complete = CheckKeptInt4(plan);
    if (!complete) return absl::OkStatus();
    // A zero-point target's sources have their weights' rows (8 per stored row).
    const TargetPlan* weight_plan =
        plan.part == Part::kInt4ZeroPoints ? &targets_.at(plan.weight) : nullptr;

    // Run the rule on meta tensors: the target's shape, or why it cannot be built.
    TensorGroups meta(plan.inputs.size());
    try {
      for (size_t pattern_idx = 0; pattern_idx < plan.inputs.size(); ++pattern_idx) {
        for (size_t idx = 0; idx < plan.inputs[pattern_idx].size(); ++idx) {
          const SourceRef& ref = plan.inputs[pattern_idx][idx];
          const std::optional<at::ScalarType> type = ToScalarType(ref.info->dtype);
          if (!type) {
            report_.mismatched.push_back(absl::StrCat(ref.info->name, ": dtype ",
                                                      AsAbsl(DtypeName(ref.info->dtype)),
                                                      " has no torch equivalent"));
            return absl::OkStatus();
          }
          // An FP8 or int4 source is planned as what it becomes:
          // dequantized_dtype unless the model names a dtype (which replaces
          // the plan's below); int4 in its logical shape, or, kept packed, as
          // the bytes of its words; zero points one int8 per row.
          const auto on_meta = at::TensorOptions().device(at::kMeta);
          at::Tensor t;
          if (weight_plan != nullptr) {
            const int64_t rows = weight_plan->inputs[pattern_idx][idx].logical[0];
            t = at::empty({rows, ref.info->shape[1]}, on_meta.dtype(at::kChar));
          } else if (ref.int4 && KeptInt4(plan)) {
            t = at::empty({ref.info->shape[0], ref.info->shape[1] * 4}, on_meta.dtype(at::kByte));
          } else if (ref.int4) {
            t = at::empty(ref.logical, on_meta.dtype(options_.dequantized_dtype));
          } else {
            t = at::empty(ref.info->shape,
                          on_meta.dtype(ref.is_fp8() ? options_.dequantized_dtype : *type));
          }
          if (rule.packed_experts) {
            const int64_t num_stored = t.dim() > 0 ? t.size(0) : 0;
            plan.first_row = options_.first_expert;
            plan.num_rows = options_.num_experts.value_or(num_stored - plan.first_row);
            report_.num_global_experts = std::max(report_.num_global_experts, num_stored);
            if (plan.first_row < 0 || plan.num_rows < 0 ||
                plan.first_row + plan.num_rows > num_stored) {
              report_.mismatched.push_back(absl::StrCat(plan.name, ": ", ref.info->name, " holds ",
                                                        num_stored, " experts, this rank needs [",
                                                        plan.first_row, ", ",
                                                        plan.first_row + plan.num_rows, ")"));
              return absl::OkStatus();
            }
            t = t.narrow(0, plan.first_row, plan.num_rows);
          }
          meta[pattern_idx].push_back(t);
        }
      }
    } catch (const c10::Error& e) {
      report_.mismatched.push_back(absl::StrCat(plan.name, ": ", e.what_without_backtrace()));
      return absl::OkStatus();
    }
    absl::StatusOr<TensorGroups> result = ApplyOps(rule.ops, std::move(meta));
    if (!result.ok()) {
      report_.mismatched.push_back(absl::StrCat(plan.name, ": ", result.status().message()));
      return absl::OkStatus();
    }
    const at::Tensor& out = (*result)[0][0];
    plan.shape.assign(out.sizes().begin(), out.sizes().end());
    plan.dtype = out.scalar_type();
    if (const auto it = options_.expected.find(plan.name); it != options_.expected.end()) {
      if (it->second.shape != plan.shape) {
        report_.mismatched.push_back(absl::StrCat(plan.name, ": checkpoint gives ",
                                                  ShapeString(plan.shape), ", model expects ",
                                                  ShapeString(it->second.shape)));
      }
      // Kept int4's companions are what the kernels read: as stored, no conversion.
      if (plan.dtype != it->second.dtype &&
          (plan.part == Part::kInt4Scales || plan.part == Part::kInt4ZeroPoints)) {
        report_.mismatched.push_back(absl::StrCat(
            plan.name, ": the ", plan.part == Part::kInt4Scales ? "scales" : "zero points",
            " of a target kept packed int4 are ", c10::toString(plan.dtype), ", model expects ",
            c10::toString(it->second.dtype)));
      }
      plan.dtype = it->second.dtype;
    }
    return absl::OkStatus();
  }

  // Every destination the caller gave is a wanted target's, and a contiguous
  // CPU tensor of its planned shape and dtype: the fill paths below write
  // through data_ptr() and pread() straight into it. All unusable ones are
  // named in one error, before anything is read.
  absl::Status CheckDestinations() const {
    if (options_.destinations.empty()) return absl::OkStatus();
    std::map<std::string_view, const TargetPlan*> wanted;
    for (const TargetPlan* plan : wanted_) wanted.emplace(plan->name, plan);
    std::vector<std::string> problems;
    for (const auto& [name, dst] : options_.destinations) {
      const auto it = wanted.find(name);
      if (it == wanted.end()) {
        problems.push_back(absl::StrCat(name, ": not a tensor this load produces"));
        continue;
      }
      const TargetPlan& plan = *it->second;
      if (dst.defined() && dst.device().is_cpu() && dst.layout() == at::kStrided &&
          dst.is_contiguous() && dst.scalar_type() == plan.dtype &&
          dst.sizes() == at::IntArrayRef(plan.shape)) {
        continue;
      }
      const std::string got =
          dst.defined() ? absl::StrCat(dst.is_contiguous() ? "" : "non-contiguous ",
                                       c10::toString(dst.scalar_type()), " ",
                                       ShapeString(dst.sizes()), " on ", dst.device().str())
                        : "undefined";
      problems.push_back(absl::StrCat(name, ": destination is ", got, ", the target is ",
                                      c10::toString(plan.dtype), " ", ShapeString(plan.shape),
                                      " (contiguous, on cpu)"));
    }
    if (problems.empty()) return absl::OkStatus();
    SortNames(problems);
    return absl::InvalidArgumentError(
        absl::StrCat("LoadCheckpoint(", dir_.string(), "): ", problems.size(),
                     " unusable destinations: ", absl::StrJoin(problems, "; ")));
  }

  // Whether the model keeps `plan`'s target in an FP8 dtype (its sources'
  // bytes as they are, their scales beside them).
  bool KeptFp8(const TargetPlan& plan) const {
    const auto it = options_.expected.find(plan.name);
    return !plan.companion() && it != options_.expected.end() && IsFp8Dtype(it->second.dtype);
  }

  // Whether the model keeps `plan`'s target packed int4 (its sources' words
  // as bytes, their scales and zero points beside them).
  bool KeptInt4(const TargetPlan& plan) const {
    const auto it = options_.expected.find(plan.name);
    return options_.int4 && !plan.companion() && it != options_.expected.end() &&
           it->second.dtype == at::kByte;
  }

  // A target kept packed int4 is built by the routed experts' rule (experts
  // merged along dim 0, gate and up then joined along the rows: whole rows of
  // bytes, so any width works) from int4 sources of one width with BF16
  // scales, and its scales (and zero points) are expected too.
  bool CheckKeptInt4(const TargetPlan& plan) {
    const MappingRule& rule = *plan.rule;
    const std::vector<ConversionOp>& ops = rule.ops;
    const bool experts_rule =
        !ops.empty() && ops[0].kind == Kind::kMergeModulelist && ops[0].dim == 0 &&
        (ops.size() == 1 ||
         (ops.size() == 2 && ops[1].kind == Kind::kConcatenate && ops[1].dim == 1));
    if (!experts_rule) {
      report_.mismatched.push_back(absl::StrCat(
          plan.name, ": kept packed int4 (uint8), but its rule (", table_.file, ":", rule.line,
          ") is not the routed experts' (experts merged along dim 0, then joined along the rows)"));
      return false;
    }
    int64_t cols = -1;
    for (const auto& refs : plan.inputs) {
      for (const SourceRef& ref : refs) {
        if (!ref.int4) {
          report_.mismatched.push_back(absl::StrCat(
              ref.info->name, ": stored as ", AsAbsl(DtypeName(ref.info->dtype)), ", but ",
              plan.name, " is kept packed int4 (uint8), which needs pack-quantized sources"));
          return false;
        }
        if (ref.scale_info->dtype != Dtype::kBF16) {
          report_.mismatched.push_back(absl::StrCat(
              ref.scale_info->name, ": ", AsAbsl(DtypeName(ref.scale_info->dtype)), " scales, but ",
              plan.name, " is kept packed int4 with its scales as stored, which must be BF16"));
          return false;
        }
        if (cols >= 0 && ref.logical[1] != cols) {
          report_.mismatched.push_back(absl::StrCat(plan.name, ": kept packed int4, its parts are ",
                                                    cols, " and ", ref.logical[1],
                                                    " columns wide (", ref.info->name, ")"));
          return false;
        }
        cols = ref.logical[1];
      }
    }
    bool ok = true;
    for (std::string_view suffix : {kScaleSuffix, kZeroPointSuffix}) {
      if (suffix == kZeroPointSuffix && options_.int4->symmetric) continue;
      const std::string companion = absl::StrCat(plan.name, AsAbsl(suffix));
      if (!options_.expected.contains(companion)) {
        report_.mismatched.push_back(absl::StrCat(
            plan.name, ": kept packed int4, which is read with its ",
            suffix == kScaleSuffix ? "scales" : "zero points", "; expect ", companion, " too"));
        ok = false;
      }
    }
    return ok;
  }

  // A packed int4 source has its scale, shape and (asymmetric) zero point, of
  // the shapes its logical [rows, cols] -- read from the shape -- implies.
  // Problems go to the report; false when there is one.
  bool CheckInt4(const TargetPlan& plan, SourceRef& ref) {
    if (!ref.int4) return true;
    const TensorInfo& info = *ref.info;
    if (plan.rule->packed_experts || info.dtype != Dtype::kI32 || info.shape.size() != 2) {
      report_.mismatched.push_back(
          absl::StrCat(info.name,
                       ": pack-quantized int4 weights are read as I32 [rows, ceil(cols / 8)], one "
                       "per Linear; this one is ",
                       AsAbsl(DtypeName(info.dtype)), " ", ShapeString(info.shape),
                       plan.rule->packed_experts ? " (packed experts)" : ""));
      return false;
    }
    const std::string base = info.name.substr(0, info.name.size() - kPackedSuffix.size());
    bool ok = true;
    auto require = [&](const TensorInfo* companion, std::string_view suffix) {
      if (companion != nullptr) return;
      report_.missing.push_back(absl::StrCat(base, AsAbsl(suffix)));
      ok = false;
    };
    require(ref.scale_info, kScaleSuffix);
    require(ref.shape_info, kShapeSuffix);
    if (!options_.int4->symmetric) require(ref.zero_info, kZeroPointSuffix);
    if (ref.shape_info == nullptr) return false;

    const TensorInfo& shape = *ref.shape_info;
    if ((shape.dtype != Dtype::kI32 && shape.dtype != Dtype::kI64) ||
        shape.shape != std::vector<int64_t>{2}) {
      report_.mismatched.push_back(absl::StrCat(
          shape.name, ": ", AsAbsl(DtypeName(shape.dtype)), " ", ShapeString(shape.shape),
          ", the logical shape of ", info.name, " is 2 integers [rows, cols]"));
      return false;
    }
    absl::StatusOr<at::Tensor> values =
        ReadTensor(ref.shape_file->file, shape, {.dtype = at::kLong, .copy = true});
    if (!values.ok()) {
      report_.mismatched.push_back(absl::StrCat(shape.name, ": ", values.status().message()));
      return false;
    }
    bytes_read_ += shape.num_bytes();
    ++tensors_read_;
    const int64_t rows = (*values)[0].item<int64_t>();
    const int64_t cols = (*values)[1].item<int64_t>();
    if (rows != info.shape[0] || cols <= 0 || PackedInt4Words(cols) != info.shape[1]) {
      report_.mismatched.push_back(
          absl::StrCat(shape.name, ": [", rows, ", ", cols, "] does not fit ", info.name, " ",
                       ShapeString(info.shape), ", which holds [rows, ceil(cols / 8)] words"));
      return false;
    }
    ref.logical = {rows, cols};
    if (!ok) return false;

    const int64_t group_size = options_.int4->group_size;
    const std::vector<int64_t> groups = {rows, NumInt4Groups(cols, group_size)};
    const TensorInfo& scale = *ref.scale_info;
    if (scale.dtype != Dtype::kF32 && scale.dtype != Dtype::kBF16 && scale.dtype != Dtype::kF16) {
      report_.mismatched.push_back(absl::StrCat(scale.name, ": dtype ",
                                                AsAbsl(DtypeName(scale.dtype)),
                                                ", an int4 scale must be F32, BF16 or F16"));
      ok = false;
    } else if (scale.shape != groups) {
      report_.mismatched.push_back(
          absl::StrCat(scale.name, ": checkpoint gives ", ShapeString(scale.shape),
                       ", int4 weight ", info.name, " of [", rows, ", ", cols, "] in groups of ",
                       group_size, " needs ", ShapeString(groups)));
      ok = false;
    }
    if (ref.zero_info != nullptr) {
      const TensorInfo& zero = *ref.zero_info;
      const std::vector<int64_t> want = {PackedInt4Words(rows), groups[1]};
      if (zero.dtype != Dtype::kI32 || zero.shape != want) {
        report_.mismatched.push_back(absl::StrCat(
            zero.name, ": checkpoint gives ", AsAbsl(DtypeName(zero.dtype)), " ",
            ShapeString(zero.shape), ", int4 weight ", info.name, " of [", rows, ", ", cols,
            "] in groups of ", group_size, " needs I32 ", ShapeString(want), " (8 rows per word)"));
        ok = false;
      }
    }
    return ok;
  }

  // A target kept in FP8 is built from FP8 sources of its own dtype by a rule
  // that copies bytes (a rename, a merge of experts, a concatenation), and
  // every source a concatenation puts before another fills whole scale
  // blocks, so that the sources' scale grids join into the target's.
  bool CheckKeptFp8(const TargetPlan& plan) {
    const at::ScalarType want = options_.expected.at(plan.name).dtype;
    const MappingRule& rule = *plan.rule;
    if (!HasFusedPath(rule)) {
      report_.mismatched.push_back(absl::StrCat(plan.name, ": kept in ", c10::toString(want),
                                                ", but its rule (", table_.file, ":", rule.line,
                                                ") does more than place its sources' bytes"));
      return false;
    }
    const int64_t concat_dim = rule.ops.size() == 2 ? rule.ops[1].dim - 1 : -1;
    for (size_t pattern_idx = 0; pattern_idx < plan.inputs.size(); ++pattern_idx) {
      for (const SourceRef& ref : plan.inputs[pattern_idx]) {
        const std::optional<at::ScalarType> type = ToScalarType(ref.info->dtype);
        if (!type || *type != want) {
          report_.mismatched.push_back(
              absl::StrCat(ref.info->name, ": stored as ", AsAbsl(DtypeName(ref.info->dtype)),
                           ", but ", plan.name, " is kept in ", c10::toString(want),
                           ", which needs sources of that dtype with block scales"));
          return false;
        }
        if (concat_dim >= 0 && pattern_idx + 1 < plan.inputs.size() &&
            (concat_dim >= 2 ||
             ref.info->shape[concat_dim] % options_.fp8_block[concat_dim] != 0)) {
          report_.mismatched.push_back(absl::StrCat(
              plan.name, ": kept in ", c10::toString(want), ", its part ", ref.info->name, " ",
              ShapeString(ref.info->shape), " does not fill whole blocks of ",
              ShapeString(options_.fp8_block), " along dim ", concat_dim,
              ", so the parts' scales do not join into one grid"));
          return false;
        }
      }
    }
    const std::string scales = absl::StrCat(plan.name, AsAbsl(kScaleInvSuffix));
    if (!options_.expected.contains(scales)) {
      report_.mismatched.push_back(absl::StrCat(plan.name, ": kept in ", c10::toString(want),
                                                ", which is read with its scales; expect ", scales,
                                                " too"));
      return false;
    }
    return true;
  }

  // An FP8 source needs its scale, of the block grid's shape; a scale needs an
  // FP8 weight. Problems go to the report; false when there is one.
  bool CheckFp8(const TargetPlan& plan, const SourceRef& ref) {
    const TensorInfo& info = *ref.info;
    if (!IsFp8Dtype(info.dtype)) {
      if (!ref.is_fp8()) return true;
      report_.mismatched.push_back(absl::StrCat(ref.scale_info->name, ": scales ", info.name,
                                                ", which is ", AsAbsl(DtypeName(info.dtype)),
                                                ", not FP8"));
      return false;
    }
    if (!ref.is_fp8()) {
      report_.missing.push_back(info.name + options_.fp8_scale_suffix);
      return false;
    }
    const TensorInfo& scale = *ref.scale_info;
    if (plan.rule->packed_experts || info.shape.size() != 2) {
      report_.mismatched.push_back(absl::StrCat(
          info.name, ": block-scaled FP8 is read for 2-D weights only, this one is ",
          ShapeString(info.shape), plan.rule->packed_experts ? " (packed experts)" : ""));
      return false;
    }
    if (!IsScaleDtype(scale.dtype)) {
      report_.mismatched.push_back(absl::StrCat(scale.name, ": dtype ",
                                                AsAbsl(DtypeName(scale.dtype)),
                                                ", a scale must be F32, BF16, F16 or F8_E8M0"));
      return false;
    }
    const std::vector<int64_t> want = BlockScaleShape(info.shape, options_.fp8_block);
    if (scale.shape != want) {
      report_.mismatched.push_back(
          absl::StrCat(scale.name, ": checkpoint gives ", ShapeString(scale.shape), ", FP8 weight ",
                       info.name, " ", ShapeString(info.shape), " in blocks of ",
                       ShapeString(options_.fp8_block), " needs ", ShapeString(want)));
      return false;
    }
    return true;
  }

  // Stage 3: read and convert every wanted target on a bounded task graph.
  absl::StatusOr<std::map<std::string, at::Tensor>> Convert() {
    std::vector<at::Tensor> results(wanted_.size());
    std::vector<absl::Status> statuses(wanted_.size());
    const int num_threads =
        options_.num_threads > 0 ? options_.num_threads : tbb::this_task_arena::max_concurrency();
    const int max_in_flight =
        options_.max_targets_in_flight > 0 ? options_.max_targets_in_flight : num_threads;
    tbb::task_arena arena(num_threads);
    arena.execute([&] {
      tbb::flow::graph graph;
      tbb::flow::function_node<size_t, tbb::flow::continue_msg> convert(
          graph, static_cast<size_t>(max_in_flight), [&](size_t target_idx) {
            absl::StatusOr<at::Tensor> out = ConvertOne(*wanted_[target_idx]);
            if (out.ok()) {
              results[target_idx] = *std::move(out);
            } else {
              statuses[target_idx] = out.status();
            }
            return tbb::flow::continue_msg();
          });
      for (size_t target_idx = 0; target_idx < wanted_.size(); ++target_idx) {
        convert.try_put(target_idx);
      }
      graph.wait_for_all();
    });
    for (const absl::Status& status : statuses) MOEFIT_RETURN_IF_ERROR(status);
    report_.num_bytes_read = bytes_read_.load();
    report_.num_tensors_read = tensors_read_.load();
    std::map<std::string, at::Tensor> out;
    for (size_t target_idx = 0; target_idx < wanted_.size(); ++target_idx) {
      const std::string& name = wanted_[target_idx]->name;
      // The caller's own tensor, not the detached alias it was filled through.
      const auto dst = options_.destinations.find(name);
      out.emplace(
          name, dst != options_.destinations.end() ? dst->second : std::move(results[target_idx]));
    }
    return out;
  }

  absl::StatusOr<at::Tensor> ConvertOne(const TargetPlan& plan) {
    const MappingRule& rule = *plan.rule;
    const bool kept_int4 = KeptInt4(plan);
    // Views cost nothing until touched; they serve the copies that cannot pread.
    TensorGroups views(plan.inputs.size());
    for (size_t pattern_idx = 0; pattern_idx < plan.inputs.size(); ++pattern_idx) {
      for (const SourceRef& ref : plan.inputs[pattern_idx]) {
        MOEFIT_ASSIGN_OR_RETURN(at::Tensor view, ReadTensor(ref.file->file, *ref.info));
        if (rule.packed_experts) view = view.narrow(0, plan.first_row, plan.num_rows);
        // Kept packed: the words' bytes, as the target holds them.
        if (ref.int4 && kept_int4) view = view.view(at::kByte);
        views[pattern_idx].push_back(std::move(view));
        bytes_read_ += SourceBytes(plan, ref).size();
        ++tensors_read_;
        // A target kept in FP8 or packed int4 leaves its companions to their
        // own targets.
        if ((ref.is_fp8() && !IsFp8Dtype(plan.dtype)) || (ref.int4 && !kept_int4)) {
          for (const TensorInfo* companion : {ref.scale_info, ref.zero_info}) {
            if (companion == nullptr) continue;
            bytes_read_ += companion->num_bytes();
            ++tensors_read_;
          }
        }
      }
    }
    try {
      // The caller's tensor when it gave one (written through a detached alias:
      // filling a parameter's storage is not an operation for autograd to
      // record or refuse), else a new one.
      const auto dst = options_.destinations.find(plan.name);
      at::Tensor out = dst != options_.destinations.end()
                           ? dst->second.detach()
                           : at::empty(plan.shape, at::TensorOptions().dtype(plan.dtype));
      if (!HasFusedPath(rule)) {
        for (const auto& refs : plan.inputs) {
          for (const SourceRef& ref : refs) Prefetch(SourceBytes(plan, ref));
        }
        // The ops work on values: FP8 and int4 sources are widened first, one
        // at a time.
        for (size_t pattern_idx = 0; pattern_idx < views.size(); ++pattern_idx) {
          for (size_t idx = 0; idx < views[pattern_idx].size(); ++idx) {
            const SourceRef& ref = plan.inputs[pattern_idx][idx];
            if (!ref.is_fp8() && !ref.int4) continue;
            at::Tensor wide = at::empty(
                ref.int4 ? at::IntArrayRef(ref.logical) : at::IntArrayRef(ref.info->shape),
                at::TensorOptions().dtype(at::kFloat));
            MOEFIT_RETURN_IF_ERROR(Place(wide, views[pattern_idx][idx], plan, ref));
            views[pattern_idx][idx] = std::move(wide);
          }
        }
        MOEFIT_ASSIGN_OR_RETURN(TensorGroups result, ApplyOps(rule.ops, std::move(views)));
        CopyInto(out, result[0][0]);
        for (const auto& refs : plan.inputs) {
          for (const SourceRef& ref : refs) Release(SourceBytes(plan, ref));
        }
        return out;
      }
      if (rule.ops.empty()) {
        MOEFIT_RETURN_IF_ERROR(Place(out, views[0][0], plan, plan.inputs[0][0]));
        return out;
      }
      // Merge (then concatenate on dim d): expert e's part p lands in out[e] at
      // an offset along dim d - 1 of the expert's slice, as wide as the part
      // is once placed (an int4 source's logical shape, a zero point's rows).
      const int64_t num_experts = static_cast<int64_t>(views[0].size());
      const int64_t concat_dim = rule.ops.size() == 2 ? rule.ops[1].dim - 1 : -1;
      const TargetPlan* weight_plan =
          plan.part == Part::kInt4ZeroPoints ? &targets_.at(plan.weight) : nullptr;
      auto placed_size = [&](size_t pattern_idx, int64_t expert_idx) {
        const SourceRef& ref = plan.inputs[pattern_idx][expert_idx];
        if (weight_plan != nullptr && concat_dim == 0) {
          return weight_plan->inputs[pattern_idx][expert_idx].logical[0];
        }
        if (ref.int4 && !kept_int4) return ref.logical[concat_dim];
        return views[pattern_idx][expert_idx].size(concat_dim);
      };
      std::vector<absl::Status> statuses(num_experts);
      tbb::parallel_for(int64_t{0}, num_experts, [&](int64_t expert_idx) {
        at::Tensor slot = out.select(0, expert_idx);
        int64_t offset = 0;
        for (size_t pattern_idx = 0; pattern_idx < views.size(); ++pattern_idx) {
          const at::Tensor& part = views[pattern_idx][expert_idx];
          at::Tensor dst = slot;
          if (concat_dim >= 0) {
            const int64_t size = placed_size(pattern_idx, expert_idx);
            dst = slot.narrow(concat_dim, offset, size);
            offset += size;
          }
          absl::Status placed = Place(dst, part, plan, plan.inputs[pattern_idx][expert_idx]);
          if (!placed.ok() && statuses[expert_idx].ok()) statuses[expert_idx] = placed;
        }
      });
      for (const absl::Status& status : statuses) MOEFIT_RETURN_IF_ERROR(status);
      return out;
    } catch (const c10::Error& e) {
      return absl::InvalidArgumentError(absl::StrCat(dir_.string(), ": target \"", plan.name,
                                                     "\": ", e.what_without_backtrace()));
    }
  }

  // Fills `dst` with one source. When its bytes need no conversion and `dst` is
  // contiguous, pread() puts them straight from the page cache into `dst` (one
  // copy, no page faults on the mapping); otherwise they are copied (and
  // converted) from the mapping view, whose pages are dropped from this process
  // right after, so resident memory grows by the targets, not the files too.
  absl::Status Place(at::Tensor dst, const at::Tensor& view, const TargetPlan& plan,
                     const SourceRef& ref) {
    if (plan.part == Part::kInt4ZeroPoints) return UnpackZeroPoints(dst, view, ref);
    if (ref.int4 && at::isFloatingType(dst.scalar_type())) return DequantizeInt4(dst, view, ref);
    if (ref.is_fp8() && !IsFp8Dtype(dst.scalar_type())) return Dequantize(dst, view, ref);
    const std::span<const std::byte> bytes = SourceBytes(plan, ref);
    if (dst.is_contiguous() && dst.scalar_type() == view.scalar_type() &&
        dst.nbytes() == bytes.size()) {
      const std::span<const std::byte> whole = ref.file->file.TensorBytes(*ref.info);
      const uint64_t offset = ref.file->data_offset + ref.info->begin +
                              static_cast<uint64_t>(bytes.data() - whole.data());
      return PreadAll(*ref.file, offset, static_cast<std::byte*>(dst.data_ptr()), bytes.size(),
                      ref.info->name);
    }
    Prefetch(bytes);
    CopyInto(dst, view);
    Release(bytes);
    return absl::OkStatus();
  }

  // Runs `convert` over `ref`'s source bytes, prefetched before and dropped
  // from this process after, as in Place; an error names the tensor and its
  // scale.
  template <typename Convert>
  absl::Status ConvertSource(const SourceRef& ref, Convert convert) {
    const std::span<const std::byte> bytes = ref.file->file.TensorBytes(*ref.info);
    Prefetch(bytes);
    const absl::Status done = convert();
    Release(bytes);
    if (!done.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(ref.file->file.name(), ": tensor \"",
                                                     ref.info->name, "\" with ",
                                                     ref.scale_info->name, ": ", done.message()));
    }
    return absl::OkStatus();
  }

  // Widens the FP8 source `view` (a view of the mapping) into `dst` with the
  // source's scales, block by block.
  absl::Status Dequantize(at::Tensor dst, const at::Tensor& view, const SourceRef& ref) {
    MOEFIT_ASSIGN_OR_RETURN(at::Tensor scale, ReadTensor(ref.scale_file->file, *ref.scale_info));
    return ConvertSource(
        ref, [&] { return DequantizeBlockFp8Into(dst, view, scale, options_.fp8_block); });
  }

  // Dequantizes the packed int4 source `view` (a view of the mapping) into
  // `dst` with the source's scales and zero points, row by row.
  absl::Status DequantizeInt4(at::Tensor dst, const at::Tensor& view, const SourceRef& ref) {
    MOEFIT_ASSIGN_OR_RETURN(at::Tensor scale, ReadTensor(ref.scale_file->file, *ref.scale_info));
    at::Tensor zero_point;
    if (ref.zero_info != nullptr) {
      MOEFIT_ASSIGN_OR_RETURN(zero_point, ReadTensor(ref.zero_file->file, *ref.zero_info));
    }
    return ConvertSource(ref, [&] {
      return DequantizePackedInt4Into(dst, view, scale, zero_point, options_.int4->group_size);
    });
  }

  // Unpacks one source's zero points (a view of the mapping) into `dst`.
  static absl::Status UnpackZeroPoints(at::Tensor dst, const at::Tensor& view,
                                       const SourceRef& ref) {
    const absl::Status done = UnpackInt4ZeroPointsInto(dst, view);
    if (!done.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(ref.file->file.name(), ": tensor \"",
                                                     ref.info->name, "\": ", done.message()));
    }
    return absl::OkStatus();
  }

  // pread() of [offset, offset + num_bytes) into `out`, large ranges in parallel blocks.
  static absl::Status PreadAll(const OpenedFile& file, uint64_t offset, std::byte* out,
                               size_t num_bytes, const std::string& tensor_name) {
    const size_t num_blocks = (num_bytes + kParallelCopyBlockBytes - 1) / kParallelCopyBlockBytes;
    std::atomic<int> error{0};
    auto read_block = [&](size_t block_idx) {
      size_t done = block_idx * kParallelCopyBlockBytes;
      const size_t end = std::min(num_bytes, done + kParallelCopyBlockBytes);
      while (done < end) {
        const ssize_t n =
            ::pread(file.fd, out + done, end - done, static_cast<off_t>(offset + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          int expected = 0;
          error.compare_exchange_strong(expected, n < 0 ? errno : EIO);
          return;
        }
        done += static_cast<size_t>(n);
      }
    };
    if (num_blocks <= 1) {
      read_block(0);
    } else {
      tbb::parallel_for(size_t{0}, num_blocks, read_block);
    }
    if (error.load() != 0) {
      return absl::ErrnoToStatus(error.load(), absl::StrCat(file.file.name(), ": tensor \"",
                                                            tensor_name, "\": read failed"));
    }
    return absl::OkStatus();
  }

  // The bytes of `ref` this rank reads (its rows only, for a packed source).
  static std::span<const std::byte> SourceBytes(const TargetPlan& plan, const SourceRef& ref) {
    std::span<const std::byte> bytes = ref.file->file.TensorBytes(*ref.info);
    if (!plan.rule->packed_experts || ref.info->shape.empty() || ref.info->shape[0] == 0) {
      return bytes;
    }
    const size_t row_bytes = bytes.size() / static_cast<size_t>(ref.info->shape[0]);
    return bytes.subspan(static_cast<size_t>(plan.first_row) * row_bytes,
                         static_cast<size_t>(plan.num_rows) * row_bytes);
  }

  const std::filesystem::path& dir_;
  const MappingTable& table_;
  const LoadOptions& options_;
  LoadReport& report_;

  std::optional<CheckpointDir> files_;
  std::map<std::string, TargetPlan, NaturalLessCompare> targets_;
  // FP8 weight key -> its scale's key (`_scale_inv` or `_scale`).
  std::map<std::string, std::string> scales_;
  std::vector<TargetPlan*> wanted_;
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<int64_t> tensors_read_{0};
};

void AppendNames(std::string& out, std::string_view kind, const std::vector<std::string>& names) {
  if (names.empty()) return;
  if (!out.empty()) out += "; ";
  std::vector<std::string> shown(names.begin(),
                                 names.begin() + std::min(names.size(), kMaxNamesInSummary));
  absl::StrAppend(&out, names.size(), " ", AsAbsl(kind), ": ", absl::StrJoin(shown, ", "));
  if (names.size() > shown.size())
    absl::StrAppend(&out, ", ... (", names.size() - shown.size(), " more)");
}

}  // namespace

std::string LoadReport::ProblemSummary() const {
  std::string out;
  AppendNames(out, "missing", missing);
  AppendNames(out, "unexpected", unexpected);
  AppendNames(out, "mismatched", mismatched);
  return out.empty() ? "no problems" : out;
}

namespace {

// The first on-disk key (natural order) of a per-expert weight of `table`'s
// rules that merge experts, a packed `X.weight_packed` standing for its
// `X.weight`; nullopt when the files have none.
std::optional<std::string> FirstExpertWeight(const CheckpointDir& files,
                                             const MappingTable& table) {
  auto per_expert = [&](std::string_view name) {
    return std::any_of(table.rules.begin(), table.rules.end(), [&](const MappingRule& rule) {
      return rule.merges_experts() &&
             std::any_of(rule.sources.begin(), rule.sources.end(),
                         [&](const KeyPattern& p) { return p.Match(name).has_value(); });
    });
  };
  for (const auto& [key, file_idx] : files.keys()) {
    std::string_view name = key;
    if (name.ends_with(kPackedSuffix)) name.remove_suffix(kPackedSuffix.size());
    if (per_expert(name)) return key;
  }
  return std::nullopt;
}

}  // namespace

absl::StatusOr<bool> ExpertsStoredAsFp8(const std::filesystem::path& dir, std::string_view family) {
  MOEFIT_ASSIGN_OR_RETURN(MappingTable table, MappingTableFor(family));
  MOEFIT_ASSIGN_OR_RETURN(CheckpointDir files, CheckpointDir::Scan(dir));
  const std::optional<std::string> key = FirstExpertWeight(files, table);
  if (!key) return false;
  MOEFIT_ASSIGN_OR_RETURN(auto resolved, files.Resolve(*key));
  return IsFp8Dtype(resolved.second->dtype) &&
         (files.keys().contains(absl::StrCat(*key, AsAbsl(kScaleInvSuffix))) ||
          files.keys().contains(absl::StrCat(*key, AsAbsl(kScaleSuffix))));
}

absl::StatusOr<bool> ExpertsStoredAsInt4(const std::filesystem::path& dir,
                                         std::string_view family) {
  MOEFIT_ASSIGN_OR_RETURN(MappingTable table, MappingTableFor(family));
  MOEFIT_ASSIGN_OR_RETURN(CheckpointDir files, CheckpointDir::Scan(dir));
  const std::optional<std::string> key = FirstExpertWeight(files, table);
  if (!key || !key->ends_with(kPackedSuffix)) return false;
  MOEFIT_ASSIGN_OR_RETURN(auto resolved, files.Resolve(*key));
  const std::string base = key->substr(0, key->size() - kPackedSuffix.size());
  return resolved.second->dtype == Dtype::kI32 &&
         files.keys().contains(absl::StrCat(base, AsAbsl(kScaleSuffix)));
}

absl::StatusOr<at::ScalarType> StoredWeightDtype(const std::filesystem::path& dir) {
  MOEFIT_ASSIGN_OR_RETURN(CheckpointDir files, CheckpointDir::Scan(dir));
  std::map<at::ScalarType, int64_t> elements;
  for (const auto& [key, file_idx] : files.keys()) {
    // Packed int4 weights end in `.weight_packed` and are integers: not counted.
    if (!key.ends_with(".weight") || absl::StrContains(key, "mlp.gate.")) continue;
    MOEFIT_ASSIGN_OR_RETURN(auto resolved, files.Resolve(key));
    const TensorInfo& info = *resolved.second;
    const std::optional<at::ScalarType> type = ToScalarType(info.dtype);
    if (info.shape.size() != 2 || !type || !at::isFloatingType(*type)) continue;
    elements[*type] += info.shape[0] * info.shape[1];
  }
  if (elements.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir.string(), ": no 2-D floating weight tensor (\"*.weight\")"));
  }
  return std::max_element(elements.begin(), elements.end(),
                          [](const auto& a, const auto& b) { return a.second < b.second; })
      ->first;
}

absl::StatusOr<std::map<std::string, at::Tensor>> LoadCheckpoint(const std::filesystem::path& dir,
                                                                 std::string_view family,
                                                                 const LoadOptions& options,
                                                                 LoadReport* report) {
  MOEFIT_ASSIGN_OR_RETURN(MappingTable table, MappingTableFor(family));
  return LoadCheckpoint(dir, table, options, report);
}

absl::StatusOr<std::map<std::string, at::Tensor>> LoadCheckpoint(const std::filesystem::path& dir,
                                                                 const MappingTable& table,
                                                                 const LoadOptions& options,
                                                                 LoadReport* report) {
  if (options.first_expert < 0 || (options.num_experts && *options.num_experts < 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoadCheckpoint(", dir.string(), "): negative expert slice"));
  }
  if (options.fp8_block[0] <= 0 || options.fp8_block[1] <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("LoadCheckpoint(", dir.string(),
                                                   "): FP8 block size must be positive, got ",
                                                   ShapeString(options.fp8_block)));
  }
  if (options.fp8_scale_suffix.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoadCheckpoint(", dir.string(), "): empty FP8 scale suffix"));
  }
  if (options.int4 && options.int4->group_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("LoadCheckpoint(", dir.string(),
                                                   "): int4 group size must be positive, got ",
                                                   options.int4->group_size));
  }
  const auto start = std::chrono::steady_clock::now();
  LoadReport local_report;
  LoadReport& out_report = report != nullptr ? *report : local_report;
  out_report = LoadReport();
  Loader loader(dir, table, options, out_report);
  absl::StatusOr<std::map<std::string, at::Tensor>> tensors = loader.Run();
  out_report.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return tensors;
}

}  // namespace moefit::checkpoint
