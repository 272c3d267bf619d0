// The node-local rank from MPI and the choice of GPU; see node_devices.h.
#include "parallel/node_devices.h"

#include <mpi.h>

#include "absl/strings/str_cat.h"
#include "parallel/internal/mpi_util.h"
#include "parallel/mpi_communicator.h"

namespace moefit::parallel {

absl::StatusOr<NodeRank> FindNodeRank(Communicator& world) {
  auto* mpi = dynamic_cast<MpiCommunicator*>(&world);
  if (mpi == nullptr) return NodeRank{};
  MPI_Comm node = MPI_COMM_NULL;
  MOEFIT_CHECK_FOREIGN(
      MPI_Comm_split_type(mpi->comm(), MPI_COMM_TYPE_SHARED, world.rank(), MPI_INFO_NULL, &node));
  NodeRank out;
  const absl::Status status = [&]() -> absl::Status {
    MOEFIT_CHECK_FOREIGN(MPI_Comm_rank(node, &out.local_rank));
    MOEFIT_CHECK_FOREIGN(MPI_Comm_size(node, &out.local_size));
    return absl::OkStatus();
  }();
  MOEFIT_CHECK_FOREIGN(MPI_Comm_free(&node));
  if (!status.ok()) return status;
  return out;
}

absl::StatusOr<int> ChooseGpu(const NodeRank& node, int num_gpus, const GpuChoiceOptions& options) {
  if (options.ranks_per_gpu < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.ranks_per_gpu = ", options.ranks_per_gpu, " must be >= 1"));
  }
  if (num_gpus <= 0) {
    return absl::FailedPreconditionError(
        "the dense layers are to run on a GPU, but none is visible");
  }
  const int64_t capacity = static_cast<int64_t>(num_gpus) * options.ranks_per_gpu;
  if (node.local_size > capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        node.local_size, " processes run on this node but it has ", num_gpus, " GPU",
        num_gpus == 1 ? "" : "s", " for at most ", options.ranks_per_gpu, " process",
        options.ranks_per_gpu == 1 ? "" : "es", " each (parallel.ranks_per_gpu); start at most ",
        capacity, " processes per node, set parallel.ranks_per_gpu to ",
        (node.local_size + num_gpus - 1) / num_gpus,
        " to share the GPUs, or parallel.device = cpu"));
  }
  if (GpuPerProcess(node, num_gpus)) return node.local_rank;
  // Consecutive local ranks share a GPU, as evenly as the counts allow.
  return static_cast<int>(static_cast<int64_t>(node.local_rank) * num_gpus / node.local_size);
}

bool GpuPerProcess(const NodeRank& node, int num_gpus) { return node.local_size <= num_gpus; }

}  // namespace moefit::parallel
