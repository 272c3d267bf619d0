// Parsing and checking of mapping tables (see mapping_table.h).
//
// The text is parsed with protobuf's TextFormat, which reports syntax errors by
// line and column; the rules are then checked one by one, with the line of each
// rule taken from the parser's location tree, so every message points into the
// table file.
#include "checkpoint/mapping_table.h"

#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <cctype>
#include <charconv>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/internal/embedded_tables.h"
#include "checkpoint/internal/strings.h"
#include "proto/checkpoint_mapping.pb.h"

namespace moefit::checkpoint {
namespace {

using internal::AsAbsl;
using Kind = ConversionOp::Kind;

// Collects TextFormat's first error as "<file>:<line>:<column>: <message>".
class FirstErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  explicit FirstErrorCollector(std::string_view file) : file_(file) {}

  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    if (!error_.empty()) return;
    error_ = absl::StrCat(AsAbsl(file_), ":", line + 1, ":", column + 1, ": ", message);
  }

  const std::string& error() const { return error_; }

 private:
  std::string_view file_;
  std::string error_;
};

absl::StatusOr<ConversionOp> FromProto(const proto::ConversionOp& op) {
  ConversionOp out;
  switch (op.op_case()) {
    case proto::ConversionOp::kMergeModulelist:
      out.kind = Kind::kMergeModulelist;
      out.dim = op.merge_modulelist().dim();
      break;
    case proto::ConversionOp::kSplitModulelist:
      out.kind = Kind::kSplitModulelist;
      out.dim = op.split_modulelist().dim();
      break;
    case proto::ConversionOp::kConcatenate:
      out.kind = Kind::kConcatenate;
      out.dim = op.concatenate().dim();
      break;
    case proto::ConversionOp::kChunk:
      out.kind = Kind::kChunk;
      out.dim = op.chunk().dim();
      out.num_chunks = op.chunk().num_chunks();
      if (out.num_chunks < 1) return absl::InvalidArgumentError("chunk needs num_chunks >= 1");
      break;
    case proto::ConversionOp::kTranspose:
      out.kind = Kind::kTranspose;
      out.dim = op.transpose().dim0();
      out.dim1 = op.transpose().dim1();
      if (out.dim == out.dim1) {
        return absl::InvalidArgumentError("transpose needs two different dims");
      }
      break;
    case proto::ConversionOp::kInterleave:
      out.kind = Kind::kInterleave;
      out.dim = op.interleave().dim();
      break;
    case proto::ConversionOp::kDeinterleave:
      out.kind = Kind::kDeinterleave;
      out.dim = op.deinterleave().dim();
      break;
    case proto::ConversionOp::kCast: {
      out.kind = Kind::kCast;
      const std::optional<Dtype> dtype = DtypeFromName(op.cast().dtype());
      if (!dtype) {
        return absl::InvalidArgumentError(
            absl::StrCat("cast: unknown dtype \"", op.cast().dtype(), "\""));
      }
      out.dtype = *dtype;
      if (!op.cast().reverse_dtype().empty()) {
        out.reverse_dtype = DtypeFromName(op.cast().reverse_dtype());
        if (!out.reverse_dtype) {
          return absl::InvalidArgumentError(
              absl::StrCat("cast: unknown reverse_dtype \"", op.cast().reverse_dtype(), "\""));
        }
      }
      break;
    }
    case proto::ConversionOp::OP_NOT_SET:
      return absl::InvalidArgumentError("empty op");
  }
  return out;
}

// Checks the shape of a rule's op list against its sources (see ParseMappingTable).
absl::Status CheckRule(const MappingRule& rule) {
  if (rule.sources.empty()) return absl::InvalidArgumentError("rule without a source");
  const int num_source_wildcards = rule.sources[0].num_wildcards();
  for (const KeyPattern& source : rule.sources) {
    if (source.num_wildcards() != num_source_wildcards) {
      return absl::InvalidArgumentError(
          absl::StrCat("sources of one rule must have the same number of '*': \"",
                       rule.sources[0].text(), "\" vs \"", source.text(), "\""));
    }
  }
  const bool merges = rule.merges_experts();
  const int expected_target_wildcards = num_source_wildcards - (merges ? 1 : 0);
  if (rule.target.num_wildcards() != expected_target_wildcards) {
    return absl::InvalidArgumentError(
        absl::StrCat("target \"", rule.target.text(), "\" has ", rule.target.num_wildcards(),
                     " '*', needs ", expected_target_wildcards,
                     merges ? " (the sources' less the expert index that merge_modulelist merges)"
                            : " (as many as the sources)"));
  }
  if (merges && rule.packed_experts) {
    return absl::InvalidArgumentError("packed_experts sources cannot be merged again");
  }
  // Several sources become one tensor: only merges may precede the concatenate.
  bool single = rule.sources.size() == 1;
  for (size_t op_idx = 0; op_idx < rule.ops.size(); ++op_idx) {
    const ConversionOp& op = rule.ops[op_idx];
    switch (op.kind) {
      case Kind::kMergeModulelist:
        if (op_idx != 0) {
          return absl::InvalidArgumentError("merge_modulelist must be the first op");
        }
        break;
      case Kind::kConcatenate:
        if (single) {
          return absl::InvalidArgumentError("concatenate needs several sources (and appears once)");
        }
        single = true;
        break;
      case Kind::kSplitModulelist:
      case Kind::kChunk:
        return absl::InvalidArgumentError(absl::StrCat(
            op.DebugString(),
            " gives several tensors, but a rule has one target; it appears only as the "
            "inverse of merge_modulelist / concatenate in the export direction"));
      default:
        if (!single) {
          return absl::InvalidArgumentError(
              absl::StrCat(op.DebugString(), " needs one tensor: concatenate the sources first"));
        }
    }
  }
  if (!single) {
    return absl::InvalidArgumentError(
        "a rule with several sources must concatenate them into one target");
  }
  return absl::OkStatus();
}

std::string RuleLocation(std::string_view file, int line) {
  return absl::StrCat(AsAbsl(file), ":", line, ": rule");
}

}  // namespace

std::optional<ConversionOp> ConversionOp::Inverse() const {
  ConversionOp inverse = *this;
  switch (kind) {
    case Kind::kMergeModulelist:
      inverse.kind = Kind::kSplitModulelist;
      break;
    case Kind::kSplitModulelist:
      inverse.kind = Kind::kMergeModulelist;
      break;
    case Kind::kConcatenate:
      inverse.kind = Kind::kChunk;  // num_chunks filled in by MappingRule::ReverseOps
      break;
    case Kind::kChunk:
      inverse.kind = Kind::kConcatenate;
      break;
    case Kind::kTranspose:
      break;
    case Kind::kInterleave:
      inverse.kind = Kind::kDeinterleave;
      break;
    case Kind::kDeinterleave:
      inverse.kind = Kind::kInterleave;
      break;
    case Kind::kCast:
      if (!reverse_dtype) return std::nullopt;
      inverse.dtype = *reverse_dtype;
      inverse.reverse_dtype = dtype;
      break;
  }
  return inverse;
}

std::string ConversionOp::DebugString() const {
  switch (kind) {
    case Kind::kMergeModulelist:
      return absl::StrCat("merge_modulelist(dim=", dim, ")");
    case Kind::kSplitModulelist:
      return absl::StrCat("split_modulelist(dim=", dim, ")");
    case Kind::kConcatenate:
      return absl::StrCat("concatenate(dim=", dim, ")");
    case Kind::kChunk:
      return absl::StrCat("chunk(dim=", dim, ", num_chunks=", num_chunks, ")");
    case Kind::kTranspose:
      return absl::StrCat("transpose(", dim, ", ", dim1, ")");
    case Kind::kInterleave:
      return absl::StrCat("interleave(dim=", dim, ")");
    case Kind::kDeinterleave:
      return absl::StrCat("deinterleave(dim=", dim, ")");
    case Kind::kCast:
      return absl::StrCat("cast(", AsAbsl(DtypeName(dtype)), ")");
  }
  return "?";
}

KeyPattern::KeyPattern(std::string_view pattern) : text_(pattern) {
  size_t start = 0;
  while (true) {
    const size_t star = pattern.find('*', start);
    pieces_.emplace_back(
        pattern.substr(start, star == std::string_view::npos ? star : star - start));
    if (star == std::string_view::npos) break;
    start = star + 1;
  }
}

std::optional<std::vector<int64_t>> KeyPattern::Match(std::string_view name) const {
  if (pieces_.empty()) return std::nullopt;
  if (!name.starts_with(pieces_[0])) return std::nullopt;
  std::vector<int64_t> numbers;
  numbers.reserve(pieces_.size() - 1);
  size_t pos = pieces_[0].size();
  for (size_t piece_idx = 1; piece_idx < pieces_.size(); ++piece_idx) {
    size_t end = pos;
    while (end < name.size() && std::isdigit(static_cast<unsigned char>(name[end]))) ++end;
    if (end == pos) return std::nullopt;
    if (name[pos] == '0' && end - pos > 1) return std::nullopt;  // leading zeros do not round-trip
    int64_t number = 0;
    const auto [ptr, ec] = std::from_chars(name.data() + pos, name.data() + end, number);
    if (ec != std::errc() || ptr != name.data() + end) return std::nullopt;
    numbers.push_back(number);
    const std::string& piece = pieces_[piece_idx];
    if (name.substr(end, piece.size()) != piece) return std::nullopt;
    pos = end + piece.size();
  }
  if (pos != name.size()) return std::nullopt;
  return numbers;
}

std::string KeyPattern::Fill(const std::vector<int64_t>& numbers) const {
  std::string out = pieces_.empty() ? std::string() : pieces_[0];
  for (size_t piece_idx = 1; piece_idx < pieces_.size(); ++piece_idx) {
    absl::StrAppend(&out, piece_idx - 1 < numbers.size() ? numbers[piece_idx - 1] : -1,
                    pieces_[piece_idx]);
  }
  return out;
}

bool MappingRule::merges_experts() const {
  return !ops.empty() && ops[0].kind == Kind::kMergeModulelist;
}

std::vector<ConversionOp> MappingRule::ReverseOps() const {
  std::vector<ConversionOp> reverse;
  for (auto it = ops.rbegin(); it != ops.rend(); ++it) {
    std::optional<ConversionOp> inverse = it->Inverse();
    if (!inverse) continue;
    if (inverse->kind == Kind::kChunk) inverse->num_chunks = static_cast<int64_t>(sources.size());
    reverse.push_back(*inverse);
  }
  return reverse;
}

absl::StatusOr<MappingTable> ParseMappingTable(std::string_view text, std::string_view file) {
  proto::MappingTable table_proto;
  google::protobuf::TextFormat::Parser parser;
  FirstErrorCollector errors(file);
  parser.RecordErrorsTo(&errors);
  google::protobuf::TextFormat::ParseInfoTree locations;
  parser.WriteLocationsTo(&locations);
  const std::string text_copy(text);
  if (!parser.ParseFromString(text_copy, &table_proto)) {
    return absl::InvalidArgumentError(
        errors.error().empty() ? absl::StrCat(AsAbsl(file), ": cannot parse mapping table")
                               : errors.error());
  }
  MappingTable table;
  table.file = std::string(file);
  table.family = table_proto.family();
  if (table.family.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(AsAbsl(file), ":1:1: no family given"));
  }
  const google::protobuf::Descriptor* descriptor = proto::MappingTable::descriptor();
  const google::protobuf::FieldDescriptor* rule_field = descriptor->FindFieldByName("rule");
  const google::protobuf::FieldDescriptor* ignore_field = descriptor->FindFieldByName("ignore");
  const google::protobuf::FieldDescriptor* op_field =
      proto::MappingRule::descriptor()->FindFieldByName("op");
  for (int rule_idx = 0; rule_idx < table_proto.rule_size(); ++rule_idx) {
    const proto::MappingRule& rule_proto = table_proto.rule(rule_idx);
    const int line = locations.GetLocation(rule_field, rule_idx).line + 1;
    const google::protobuf::TextFormat::ParseInfoTree* rule_tree =
        locations.GetTreeForNested(rule_field, rule_idx);
    MappingRule rule;
    rule.line = line;
    rule.packed_experts = rule_proto.packed_experts();
    for (const std::string& source : rule_proto.source()) rule.sources.emplace_back(source);
    for (int op_idx = 0; op_idx < rule_proto.op_size(); ++op_idx) {
      absl::StatusOr<ConversionOp> op = FromProto(rule_proto.op(op_idx));
      if (!op.ok()) {
        const int op_line =
            rule_tree != nullptr ? rule_tree->GetLocation(op_field, op_idx).line + 1 : line;
        return absl::InvalidArgumentError(
            absl::StrCat(AsAbsl(file), ":", op_line, ": op: ", op.status().message()));
      }
      rule.ops.push_back(*op);
    }
    if (!rule_proto.target().empty()) {
      rule.target = KeyPattern(rule_proto.target());
    } else if (rule.sources.size() == 1) {
      rule.target = rule.sources[0];
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(RuleLocation(file, line), ": several sources need an explicit target"));
    }
    if (absl::Status checked = CheckRule(rule); !checked.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(RuleLocation(file, line), ": ", checked.message()));
    }
    table.rules.push_back(std::move(rule));
  }
  for (int ignore_idx = 0; ignore_idx < table_proto.ignore_size(); ++ignore_idx) {
    if (table_proto.ignore(ignore_idx).empty()) {
      const int line = locations.GetLocation(ignore_field, ignore_idx).line + 1;
      return absl::InvalidArgumentError(
          absl::StrCat(AsAbsl(file), ":", line, ": empty ignore pattern"));
    }
    table.ignore.emplace_back(table_proto.ignore(ignore_idx));
  }
  for (const std::string& pattern : table_proto.keep_float32()) {
    table.keep_float32.emplace_back(pattern);
  }
  return table;
}

absl::StatusOr<MappingTable> MappingTableFor(std::string_view family) {
  for (const internal::EmbeddedTable& embedded : internal::EmbeddedTables()) {
    if (embedded.family != family) continue;
    absl::StatusOr<MappingTable> table = ParseMappingTable(embedded.text, embedded.file);
    if (table.ok() && table->family != family) {
      return absl::InternalError(absl::StrCat(AsAbsl(embedded.file), ": declares family \"",
                                              table->family, "\", registered as \"", AsAbsl(family),
                                              "\""));
    }
    return table;
  }
  return absl::NotFoundError(
      absl::StrCat("no checkpoint mapping table for model family \"", AsAbsl(family),
                   "\"; known: ", absl::StrJoin(RegisteredFamilies(), ", ")));
}

std::vector<std::string> RegisteredFamilies() {
  std::vector<std::string> families;
  for (const internal::EmbeddedTable& embedded : internal::EmbeddedTables()) {
    families.emplace_back(embedded.family);
  }
  return families;
}

}  // namespace moefit::checkpoint
