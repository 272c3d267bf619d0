// The run settings' defaults and ranges as proto/config.proto states them, in
// its field options `default_value`, `range` and `default_when_absent`:
// filling a config's unset fields, checking every value against its range
// with one message form, and reading the default of a field left unset.
#pragma once

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include <string>

#include "absl/status/status.h"
#include "proto/config.pb.h"

namespace moefit::launch {

// Sets every field of `config` (but the model's) that has a `default_value`
// and no `default_when_absent` to that value: what a config starts from
// before its file and overrides are merged onto it.
void FillConfigDefaults(proto::Config* config);

// Sets `field` of `message` to its `default_value` (strings as written, other
// types parsed as text format); false if it has none or it does not parse.
bool SetToDefault(const google::protobuf::FieldDescriptor& field,
                  google::protobuf::Message* message);

// Checks every field with a `range` (a field with explicit presence only when
// it is set): InvalidArgument "section.field = VALUE must be ..." for the
// first value outside its range, in the schema's order.
absl::Status CheckConfigRanges(const proto::Config& config);

// The value of `message`'s `field` when it is set, else its `default_value`.
double DoubleOrDefault(const google::protobuf::Message& message, const std::string& field);

// What a range allows, parsed from its text ("> 0", ">= 2", "[0, 1)" and a
// note in parentheses); exposed for tests.
struct FieldRange {
  double low = 0;
  bool low_open = false;  // "> low" rather than ">= low"
  bool bounded = false;   // an upper bound
  double high = 0;
  bool high_open = false;
  std::string note;  // repeated in parentheses after the message
  bool Contains(double v) const;
  // "positive", ">= 2", "in [0, 1)", with " (note)" when there is one.
  std::string Describe() const;
};
FieldRange ParseFieldRange(const std::string& text);

// Whether `field` carries the option (exposed for tests).
std::string DefaultValueOf(const google::protobuf::FieldDescriptor& field);
std::string RangeOf(const google::protobuf::FieldDescriptor& field);
bool DefaultWhenAbsent(const google::protobuf::FieldDescriptor& field);

}  // namespace moefit::launch
