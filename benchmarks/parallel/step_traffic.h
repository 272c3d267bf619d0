// Bytes that cross between the ranks of an expert-parallel group in the token
// exchange of a training step, counted rather than timed: the alltoall
// dispatcher runs over a CountingCommunicator (parallel/counting_communicator.h),
// which adds up what each all-to-all sends to other ranks (rows, routing
// weights, local expert indices, counts; a rank's rows for itself excluded).
// Shared by dispatch_bench and dispatch_bytes.
//
// "after" is what moefit sends: with deduplication, one row per (token, owner
// rank) pair with its k routing weights (float32) and k local expert indices
// (int64), and one summed row back (in the dtype of the sums, at least
// float32). "before" is what moefit's dispatch sent before deduplication,
// computed from the same routing: per-expert counts first ([ranks, experts
// per rank] int64), then one row per (token, slot) to the expert's owner and
// the expert's output row back, both in the experts' dtype, the routing
// weights applied at home (nothing else travels). Backward moves the same rows
// the opposite way (after: with the routing weights' gradients).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "framework/data.h"
#include "framework/model.h"
#include "parallel/communicator.h"
#include "parallel/counting_communicator.h"
#include "router/expert_placement.h"

namespace moefit::bench {

// Summed over every rank (and every MoE layer counted).
struct ExchangeBytes {
  // Hidden-state rows sent to other ranks by the forward dispatch.
  int64_t rows = 0;
  int64_t forward = 0, backward = 0;
  int64_t total() const { return forward + backward; }
  ExchangeBytes& operator+=(const ExchangeBytes& o);
};

struct StepTraffic {
  ExchangeBytes before, after;
  // Tokens in the step (all ranks) and MoE layers counted.
  int64_t tokens = 0, layers = 0;
};

// One MoE layer's exchange under uniform routing: `tokens_per_rank` tokens on
// each rank of `world`, each routed to `top_k` distinct experts drawn
// uniformly from `num_experts` (placed contiguously), rows of `hidden` in
// `dtype`, through the alltoall dispatcher forward and backward (identity
// experts). Checks that the counted bytes are the ones the pairs predict and
// ends the job (AbortAll) if not. Collective.
StepTraffic CountUniformLayer(const std::shared_ptr<parallel::Communicator>& world,
                              int64_t tokens_per_rank, int64_t hidden, int64_t top_k,
                              int64_t num_experts, at::ScalarType dtype, uint64_t seed);

// One forward and backward (cross entropy of the next token) of `model`, built
// with `counting` as its expert group, on `batch` (this rank's sequences).
// The model's own routing decides what travels. Collective.
StepTraffic CountModelStep(framework::MoeModel& model, parallel::CountingCommunicator& counting,
                           parallel::Communicator& world, const framework::Batch& batch);

// Rank 0 prints one line each for before and after, and the saving, under
// `label`.
void PrintTraffic(int rank, const std::string& label, const StepTraffic& t);

}  // namespace moefit::bench
