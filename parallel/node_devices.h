// Which GPU each process drives: one per process on its node, chosen by the
// process's rank among the processes of the same node.
//
// mpirun places processes on nodes; only MPI knows which of them share a
// node, so the node-local rank comes from MPI's shared-memory split
// (MPI_Comm_split_type with MPI_COMM_TYPE_SHARED). The choice of device from
// it is a pure function, so that the rules (and their error messages) are
// tested without GPUs.
//
// Sharing: by default each process needs a GPU of its own, and more processes
// on a node than GPUs is an error. ranks_per_gpu > 1 lets up to that many
// consecutive local ranks share one GPU (to test a multi-process job on a
// single-GPU machine, or to give small dense parts to several CPU sockets):
// they then time-slice it, and NCCL, which refuses two ranks of one
// communicator on a GPU, cannot sum their gradients.
#pragma once

#include "absl/status/statusor.h"
#include "parallel/communicator.h"

namespace moefit::parallel {

struct NodeRank {
  int local_rank = 0;  // among the processes of this node, in world rank order
  int local_size = 1;  // processes on this node
};

// Collective over `world`: this process's rank among those of `world` that
// share its node. An MPI communicator asks MPI (MPI_Comm_split_type); any
// other backend is one process alone ({0, 1}).
absl::StatusOr<NodeRank> FindNodeRank(Communicator& world);

struct GpuChoiceOptions {
  // Local ranks that may share one GPU (>= 1).
  int ranks_per_gpu = 1;
};

// The CUDA device index for `node` with `num_gpus` visible GPUs: local rank r
// of L takes GPU r when L <= num_gpus, else GPU floor(r x num_gpus / L), so
// consecutive ranks share one, at most ranks_per_gpu, as evenly as the counts
// allow. InvalidArgument, naming both counts, when the
// node has more processes than num_gpus x ranks_per_gpu allows;
// FailedPrecondition when num_gpus is 0.
absl::StatusOr<int> ChooseGpu(const NodeRank& node, int num_gpus,
                              const GpuChoiceOptions& options = {});

// Whether every process of the node has a GPU to itself under ChooseGpu's
// rule (what NCCL requires).
bool GpuPerProcess(const NodeRank& node, int num_gpus);

}  // namespace moefit::parallel
