// Factories of the dispatchers, for the registry in dispatcher.cc only.
#pragma once

#include <memory>

#include "parallel/dispatcher.h"

namespace moefit::parallel {

std::unique_ptr<Dispatcher> CreateAllToAllDispatcher(std::shared_ptr<Communicator> ep,
                                                     const router::ExpertPlacement& placement);
std::unique_ptr<Dispatcher> CreateAllGatherDispatcher(std::shared_ptr<Communicator> ep,
                                                      const router::ExpertPlacement& placement);

}  // namespace moefit::parallel
