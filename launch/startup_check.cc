// The start-up consistency check of moefit's commands; see startup_check.h.
#include "launch/startup_check.h"

#include <c10/util/hash.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace moefit::launch {
namespace {

// "<dir>: config.json sha1 ..., model.safetensors.index.json sha1 ...": the
// small files that say what a model or adapter directory holds.
std::string DirectoryIdentity(const std::string& dir) {
  if (dir.empty()) return "none";
  std::string out = dir;
  for (const char* name : {"config.json", "model.safetensors.index.json", "adapter_config.json"}) {
    const std::filesystem::path path = std::filesystem::path(dir) / name;
    std::ifstream in(path, std::ios::binary);
    if (!in) continue;
    std::ostringstream contents;
    contents << in.rdbuf();
    absl::StrAppend(&out, "\n", name, " sha1 ", c10::sha1(contents.str()).str());
  }
  return out;
}

}  // namespace

std::string FlattenTextFormat(const std::string& text) {
  std::vector<std::string> path;
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipWhitespace())) {
    line = absl::StripAsciiWhitespace(line);
    if (line == "}") {
      if (!path.empty()) path.pop_back();
    } else if (absl::EndsWith(line, "{")) {
      path.emplace_back(absl::StripAsciiWhitespace(absl::StripSuffix(line, "{")));
    } else {
      lines.push_back(path.empty() ? std::string(line)
                                   : absl::StrCat(absl::StrJoin(path, "."), ".", line));
    }
  }
  return absl::StrJoin(lines, "\n");
}

std::vector<parallel::JobFact> StartupFacts(const RunConfig& run, const std::string& version) {
  return {
      {"moefit version", version},
      {"resolved config", FlattenTextFormat(run.config_text)},
      {"checkpoint (model.model_path)", DirectoryIdentity(run.model_path)},
      {"LoRA adapter (lora.init_from / lora.adapter_path)", DirectoryIdentity(run.lora_init_from)},
  };
}

absl::Status CheckStartupConsistency(const RunConfig& run, const std::string& version,
                                     parallel::Communicator& world) {
  return parallel::CheckSameOnAllRanks(world, StartupFacts(run, version));
}

}  // namespace moefit::launch
