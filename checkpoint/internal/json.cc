// Duplicate-key and depth checks on top of nlohmann's callback parser.
//
// The callback sees object_start / key / object_end events in document order,
// so a stack of per-object key sets is enough to find repeats. The callback
// cannot return an error (returning false only discards a value), so the first
// problem is recorded and parsing is stopped by throwing a private exception
// type that never leaves this file. NUL bytes are rejected up front because
// nlohmann stops reading at the first one.
#include "checkpoint/internal/json.h"

#include <string>
#include <unordered_set>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/internal/strings.h"

namespace moefit::checkpoint::internal {
namespace {

using Json = nlohmann::ordered_json;

// Thrown from the callback to abandon a parse; caught in this file only.
struct StopParse {};

struct ObjectScope {
  std::unordered_set<std::string> keys;
  std::string last_key;  // the member currently being parsed
};

}  // namespace

absl::StatusOr<Json> ParseJsonRejectingDuplicates(std::string_view text, std::string_view context) {
  std::vector<ObjectScope> scopes;
  int depth = 0;
  std::string problem;

  auto callback = [&](int /*nlohmann_depth*/, nlohmann::json::parse_event_t event,
                      Json& parsed) -> bool {
    using Event = nlohmann::json::parse_event_t;
    switch (event) {
      case Event::object_start:
      case Event::array_start:
        if (++depth > kMaxJsonDepth) {
          problem = absl::StrCat("JSON nested deeper than ", kMaxJsonDepth, " levels");
          throw StopParse{};
        }
        if (event == Event::object_start) scopes.emplace_back();
        break;
      case Event::object_end:
      case Event::array_end:
        --depth;
        if (event == Event::object_end) scopes.pop_back();
        break;
      case Event::key: {
        ObjectScope& scope = scopes.back();
        scope.last_key = parsed.get<std::string>();
        if (!scope.keys.insert(scope.last_key).second) {
          problem = absl::StrCat("duplicate key \"", scope.last_key, "\"");
          if (scopes.size() >= 2) {
            absl::StrAppend(&problem, " in \"", scopes[scopes.size() - 2].last_key, "\"");
          }
          throw StopParse{};
        }
        break;
      }
      case Event::value:
        break;
    }
    return true;
  };

  // nlohmann's lexer takes a NUL byte for the end of input and ignores the rest;
  // JSON allows no raw NUL anywhere, so reject it rather than parse a prefix.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(AsAbsl(context), ": malformed JSON: NUL byte at offset ", nul));
  }
  try {
    return Json::parse(text.begin(), text.end(), callback);
  } catch (const StopParse&) {
    return absl::InvalidArgumentError(absl::StrCat(AsAbsl(context), ": ", problem));
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(AsAbsl(context), ": malformed JSON: ", e.what()));
  }
}

}  // namespace moefit::checkpoint::internal
