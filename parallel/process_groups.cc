// Builds the expert-parallel, expert-data-parallel and data-parallel groups by
// splitting the world (see the header for their shapes).
#include "parallel/process_groups.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace moefit::parallel {

absl::StatusOr<ProcessGroups> MakeProcessGroups(std::shared_ptr<Communicator> world,
                                                const ProcessGroupsOptions& options) {
  if (world == nullptr)
    return absl::InvalidArgumentError("MakeProcessGroups: no world communicator");
  const int world_size = world->size();
  const int ep_size = options.ep_size == 0 ? world_size : options.ep_size;
  if (ep_size < 1 || ep_size > world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("ep_size ", options.ep_size, " must be in [1, world size ", world_size, "]"));
  }
  if (world_size % ep_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size ", world_size, " is not divisible by ep_size ", ep_size,
                     ": expert parallelism needs whole groups of ep_size ranks, each "
                     "holding one copy of the experts"));
  }
  const int rank = world->rank();
  ProcessGroups groups;
  groups.ep_size = ep_size;
  groups.ep_group_idx = rank / ep_size;
  // Both splits are collective over the world and every rank joins one group
  // of each; keys keep the world's rank order inside each group.
  absl::StatusOr<std::shared_ptr<Communicator>> expert_parallel =
      world->Split(/*color=*/groups.ep_group_idx, /*key=*/rank, "ep");
  if (!expert_parallel.ok()) return expert_parallel.status();
  absl::StatusOr<std::shared_ptr<Communicator>> expert_data_parallel =
      world->Split(/*color=*/rank % ep_size, /*key=*/rank, "edp");
  if (!expert_data_parallel.ok()) return expert_data_parallel.status();
  groups.expert_parallel = *std::move(expert_parallel);
  groups.expert_data_parallel = *std::move(expert_data_parallel);
  groups.data_parallel = world;
  groups.world = std::move(world);
  return groups;
}

}  // namespace moefit::parallel
