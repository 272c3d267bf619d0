// Strict JSON parsing for checkpoint headers and index files (internal).
//
// nlohmann::json silently keeps one value when an object repeats a key. For a
// safetensors header that would hide a second tensor of the same name, and for
// an index it would hide a tensor mapped to two shards, so both must be errors.
// This parser watches the key events of nlohmann's parser callback and reports
// the first repeated key at any depth. It also bounds nesting depth (no valid
// header nests more than a few levels), so a hostile file cannot make the
// parser allocate one object per byte of a 100 MB header.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace moefit::checkpoint::internal {

// Deepest nesting of arrays and objects accepted (serde_json's default limit).
inline constexpr int kMaxJsonDepth = 128;

// Parses `text` keeping object members in file order. On failure the message
// starts with `context` (e.g. "<file>: header") and says what is wrong:
// malformed JSON (with nlohmann's position), a duplicate key (naming the key and
// the key of the object that holds it), or nesting beyond kMaxJsonDepth.
absl::StatusOr<nlohmann::ordered_json> ParseJsonRejectingDuplicates(std::string_view text,
                                                                    std::string_view context);

}  // namespace moefit::checkpoint::internal
