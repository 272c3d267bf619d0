// Defaults and ranges from the config schema's field options; see
// config_fields.h.
#include "launch/config_fields.h"

#include <google/protobuf/text_format.h>

#include <cmath>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "c10/util/Exception.h"

namespace moefit::launch {

namespace pb = google::protobuf;

std::string DefaultValueOf(const pb::FieldDescriptor& field) {
  return field.options().GetExtension(proto::default_value);
}
std::string RangeOf(const pb::FieldDescriptor& field) {
  return field.options().GetExtension(proto::range);
}
bool DefaultWhenAbsent(const pb::FieldDescriptor& field) {
  return field.options().GetExtension(proto::default_when_absent);
}

namespace {

double ParseBound(absl::string_view text, const std::string& range) {
  double v = 0;
  text = absl::StripAsciiWhitespace(text);
  if (text == "inf") return std::numeric_limits<double>::infinity();
  TORCH_CHECK(absl::SimpleAtod(text, &v), "config.proto: range '", range, "': bad bound '",
              std::string(text), "'");
  return v;
}

// The sections of the config that hold run settings: every message field of
// Config but the model's.
template <typename Fn>
void ForEachSetting(const pb::Descriptor& config, Fn fn) {
  for (int i = 0; i < config.field_count(); ++i) {
    const pb::FieldDescriptor* section = config.field(i);
    if (section->type() != pb::FieldDescriptor::TYPE_MESSAGE ||
        section->message_type() == proto::ModelConfig::descriptor()) {
      continue;
    }
    const pb::Descriptor* d = section->message_type();
    for (int j = 0; j < d->field_count(); ++j) fn(*section, *d->field(j));
  }
}

// A numeric field's value as a double, and as the message prints it.
std::pair<double, std::string> NumericValue(const pb::Message& m, const pb::FieldDescriptor& f) {
  const pb::Reflection& r = *m.GetReflection();
  const auto number = [](auto v) {
    return std::pair<double, std::string>(static_cast<double>(v), absl::StrCat(v));
  };
  switch (f.cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_INT32:
      return number(r.GetInt32(m, &f));
    case pb::FieldDescriptor::CPPTYPE_INT64:
      return number(r.GetInt64(m, &f));
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
      return number(r.GetDouble(m, &f));
    default:
      TORCH_CHECK(false, "config.proto: ", f.full_name(),
                  " has a range but is not an int32, int64 or double");
  }
}

}  // namespace

FieldRange ParseFieldRange(const std::string& text) {
  FieldRange r;
  absl::string_view body = text;
  const size_t paren = body.find(" (");
  if (paren != absl::string_view::npos) {
    TORCH_CHECK(body.back() == ')', "config.proto: range '", text, "': unclosed note");
    r.note = std::string(body.substr(paren + 2, body.size() - paren - 3));
    body = body.substr(0, paren);
  }
  if (absl::ConsumePrefix(&body, ">=")) {
    r.low = ParseBound(body, text);
  } else if (absl::ConsumePrefix(&body, ">")) {
    r.low = ParseBound(body, text);
    r.low_open = true;
  } else if (!body.empty() && (body.front() == '[' || body.front() == '(') &&
             (body.back() == ']' || body.back() == ')')) {
    r.low_open = body.front() == '(';
    r.high_open = body.back() == ')';
    const std::vector<absl::string_view> ends =
        absl::StrSplit(body.substr(1, body.size() - 2), ',');
    TORCH_CHECK(ends.size() == 2, "config.proto: range '", text, "' needs two bounds");
    r.low = ParseBound(ends[0], text);
    r.high = ParseBound(ends[1], text);
    r.bounded = true;
  } else {
    TORCH_CHECK(false, "config.proto: range '", text, "' is not '> a', '>= a' or '[a, b)'");
  }
  return r;
}

bool FieldRange::Contains(double v) const {
  if (!(low_open ? v > low : v >= low)) return false;  // NaN fails here
  if (bounded && !(high_open ? v < high : v <= high)) return false;
  return true;
}

std::string FieldRange::Describe() const {
  std::string what;
  if (!bounded) {
    what = low_open && low == 0 ? "positive" : absl::StrCat(low_open ? "> " : ">= ", low);
  } else {
    what = absl::StrCat("in ", low_open ? "(" : "[", low, ", ", high, high_open ? ")" : "]");
  }
  return note.empty() ? what : absl::StrCat(what, " (", note, ")");
}

bool SetToDefault(const pb::FieldDescriptor& field, pb::Message* message) {
  const std::string value = DefaultValueOf(field);
  if (value.empty()) return false;
  if (field.cpp_type() == pb::FieldDescriptor::CPPTYPE_STRING) {
    // Written bare in the option, as a config would quote it.
    message->GetReflection()->SetString(message, &field, value);
    return true;
  }
  return pb::TextFormat::ParseFieldValueFromString(value, &field, message);
}

void FillConfigDefaults(proto::Config* config) {
  const pb::Reflection& reflection = *config->GetReflection();
  ForEachSetting(*config->GetDescriptor(),
                 [&](const pb::FieldDescriptor& section, const pb::FieldDescriptor& field) {
                   if (DefaultValueOf(field).empty() || DefaultWhenAbsent(field)) return;
                   TORCH_CHECK(SetToDefault(field, reflection.MutableMessage(config, &section)),
                               "config.proto: ", field.full_name(), "'s default_value '",
                               DefaultValueOf(field), "' does not parse");
                 });
}

absl::Status CheckConfigRanges(const proto::Config& config) {
  const pb::Reflection& reflection = *config.GetReflection();
  absl::Status status;
  ForEachSetting(*config.GetDescriptor(), [&](const pb::FieldDescriptor& section,
                                              const pb::FieldDescriptor& field) {
    const std::string text = RangeOf(field);
    if (!status.ok() || text.empty()) return;
    const pb::Message& m = reflection.GetMessage(config, &section);
    if (field.has_presence() && !m.GetReflection()->HasField(m, &field)) return;
    const FieldRange range = ParseFieldRange(text);
    const auto [v, printed] = NumericValue(m, field);
    if (!range.Contains(v)) {
      status = absl::InvalidArgumentError(absl::StrCat(section.name(), ".", field.name(), " = ",
                                                       printed, " must be ", range.Describe()));
    }
  });
  return status;
}

double DoubleOrDefault(const pb::Message& message, const std::string& name) {
  const pb::FieldDescriptor* field = message.GetDescriptor()->FindFieldByName(name);
  TORCH_CHECK(field != nullptr && field->cpp_type() == pb::FieldDescriptor::CPPTYPE_DOUBLE,
              message.GetDescriptor()->full_name(), " has no double field ", name);
  const pb::Reflection& r = *message.GetReflection();
  if (r.HasField(message, field)) return r.GetDouble(message, field);
  double v = 0;
  TORCH_CHECK(absl::SimpleAtod(DefaultValueOf(*field), &v), "config.proto: ", field->full_name(),
              " has no numeric default_value");
  return v;
}

}  // namespace moefit::launch
