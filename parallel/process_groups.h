// The groups of ranks an expert-parallel training step communicates in.
//
// With W ranks and expert-parallel degree E (W divisible by E):
//   * expert_parallel: E consecutive ranks {g*E, ..., g*E + E-1} that together
//     hold one full copy of the routed experts; token dispatch and combine run
//     here. Consecutive, so that with ranks packed per node the all-to-all stays
//     inside as few nodes as possible.
//   * expert_data_parallel: the W/E ranks at the same position in their EP
//     group, {p, p+E, p+2E, ...}: they hold replicas of the same experts, and
//     the gradients of those experts are all-reduced among them only. With
//     W == E it is a group of one (no replicas), so callers need no special case.
//   * data_parallel: every rank (the world itself); the dense parameters are
//     replicated everywhere and their gradients are all-reduced here.
// A plain struct: the step code reads the group it needs and calls it.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"

namespace moefit::parallel {

struct ProcessGroupsOptions {
  // Ranks sharing one copy of the experts; 0 means the whole world.
  int ep_size = 0;
};

struct ProcessGroups {
  std::shared_ptr<Communicator> world;
  std::shared_ptr<Communicator> expert_parallel;
  std::shared_ptr<Communicator> expert_data_parallel;
  std::shared_ptr<Communicator> data_parallel;  // the same object as world
  // Where the dense gradients are summed: the data-parallel ranks over a
  // device-side backend (NCCL) when every rank has a GPU of its own; null
  // means data_parallel itself. Set by the caller, not MakeProcessGroups.
  std::shared_ptr<Communicator> dense_gradients;
  int ep_size = 0;
  // Which copy of the experts this rank helps hold: world rank / ep_size, in
  // [0, world size / ep_size); also this rank's rank in expert_data_parallel.
  int ep_group_idx = 0;
};

// Collective over `world`: every rank calls it with the same options. Fails
// with InvalidArgument if ep_size is negative, larger than the world, or does
// not divide the world size.
absl::StatusOr<ProcessGroups> MakeProcessGroups(std::shared_ptr<Communicator> world,
                                                const ProcessGroupsOptions& options);

}  // namespace moefit::parallel
