// The explicit registry of dispatchers; see dispatcher.h.
#include "parallel/dispatcher.h"

#include <ATen/ATen.h>

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

TokenChunks SplitTokens(const at::Tensor& x, const at::Tensor& topk_idx,
                        const at::Tensor& topk_weight, int64_t num_chunks) {
  const int64_t n = x.size(0);
  std::vector<int64_t> sizes(num_chunks);
  for (int64_t c = 0; c < num_chunks; ++c) sizes[c] = n * (c + 1) / num_chunks - n * c / num_chunks;
  return {x.split_with_sizes(sizes), topk_idx.split_with_sizes(sizes),
          topk_weight.split_with_sizes(sizes)};
}

at::Tensor Dispatcher::Run(const at::Tensor& x, const at::Tensor& topk_idx,
                           const at::Tensor& topk_weight, int64_t num_chunks,
                           const ExpertCompute& experts) {
  TORCH_CHECK(num_chunks >= 1, "Dispatcher::Run: num_chunks must be at least 1, not ", num_chunks);
  if (num_chunks == 1) {
    DispatchedRows d = Dispatch(x, topk_idx, topk_weight);
    return Combine(experts(d), *d.route);
  }
  const TokenChunks chunks = SplitTokens(x, topk_idx, topk_weight, num_chunks);
  std::vector<at::Tensor> out;
  for (int64_t c = 0; c < num_chunks; ++c) {
    DispatchedRows d = Dispatch(chunks.x[c], chunks.topk_idx[c], chunks.topk_weight[c]);
    out.push_back(Combine(experts(d), *d.route));
  }
  return at::cat(out);
}

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
