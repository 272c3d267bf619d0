// The explicit registry of dispatchers; see dispatcher.h.
#include "parallel/dispatcher.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "parallel/internal/dispatchers.h"

namespace moefit::parallel {
namespace {

struct Entry {
  const char* name;
  std::unique_ptr<Dispatcher> (*create)(std::shared_ptr<Communicator>,
                                        const router::ExpertPlacement&);
};

const std::vector<Entry>& Entries() {
  static const std::vector<Entry> entries = {
      {"alltoall", &CreateAllToAllDispatcher},
      {"allgather", &CreateAllGatherDispatcher},
  };
  return entries;
}

}  // namespace

std::vector<std::string> DispatcherNames() {
  std::vector<std::string> names;
  for (const Entry& e : Entries()) names.emplace_back(e.name);
  return names;
}

absl::StatusOr<std::unique_ptr<Dispatcher>> CreateDispatcher(
    std::string_view name, std::shared_ptr<Communicator> ep, const router::ExpertPlacement& placement) {
  if (ep->size() != placement.ep_size()) {
    return absl::InvalidArgumentError(absl::StrCat("expert-parallel group of ", ep->size(),
                                                   " ranks, placement over ", placement.ep_size()));
  }
  for (const Entry& e : Entries()) {
    if (name == e.name) return e.create(std::move(ep), placement);
  }
  return absl::InvalidArgumentError(absl::StrCat("parallel.dispatcher = '", std::string(name),
                                                 "' is unknown (known: ",
                                                 absl::StrJoin(DispatcherNames(), ", "), ")"));
}

}  // namespace moefit::parallel
