// Every expert backend is listed here, once, in the order `--help` shows them.
#include "experts/registry.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "experts/eager_backend.h"
#include "experts/grouped_backend.h"

namespace moefit::experts {
namespace {

struct Entry {
  const char* name;
  std::unique_ptr<ExpertBackend> (*create)(const BackendOptions&);
};

const std::vector<Entry>& Entries() {
  static const std::vector<Entry> entries = {
      {"grouped", &CreateGroupedBackend},
      {"eager", &CreateEagerBackend},
  };
  return entries;
}

}  // namespace

std::vector<std::string> ExpertBackendNames() {
  std::vector<std::string> names;
  for (const Entry& e : Entries()) names.emplace_back(e.name);
  return names;
}

absl::StatusOr<std::unique_ptr<ExpertBackend>> CreateExpertBackend(std::string_view name,
                                                                   const BackendOptions& options) {
  for (const Entry& e : Entries()) {
    if (name == e.name) return e.create(options);
  }
  return absl::NotFoundError(absl::StrCat("unknown expert backend '", std::string(name),
                                          "' (known: ", absl::StrJoin(ExpertBackendNames(), ", "),
                                          ")"));
}

}  // namespace moefit::experts
