// The start-up consistency check; see consistency.h.
#include "parallel/consistency.h"

#include <ATen/ATen.h>
#include <c10/util/hash.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace moefit::parallel {
namespace {

constexpr int64_t kDigestChars = 40;  // SHA-1 in hex
constexpr size_t kMaxShownChars = 200;

std::string Shown(absl::string_view line) {
  if (line.size() <= kMaxShownChars) return absl::StrCat("'", line, "'");
  return absl::StrCat("'", line.substr(0, kMaxShownChars), "...'");
}

// Every rank's `value` (the values of one fact), by rank.
std::vector<std::string> GatherValues(Communicator& world, const std::string& value) {
  at::Tensor length = at::full({1}, static_cast<int64_t>(value.size()), at::kLong);
  at::Tensor lengths = at::empty({world.size()}, at::kLong);
  world.AllGather(length, lengths)->WaitOrThrow();
  std::vector<int64_t> rows(lengths.data_ptr<int64_t>(),
                            lengths.data_ptr<int64_t>() + world.size());
  at::Tensor mine = at::empty({static_cast<int64_t>(value.size())}, at::kByte);
  std::memcpy(mine.data_ptr(), value.data(), value.size());
  int64_t total = 0;
  for (int64_t n : rows) total += n;
  at::Tensor all = at::empty({total}, at::kByte);
  world.AllGatherV(mine, all, rows)->WaitOrThrow();
  std::vector<std::string> values;
  const char* data = static_cast<const char*>(all.data_ptr());
  for (int64_t n : rows) {
    values.emplace_back(data, n);
    data += n;
  }
  return values;
}

}  // namespace

std::optional<FactMismatch> FindMismatch(const std::vector<std::vector<std::string>>& digests) {
  for (size_t rank = 1; rank < digests.size(); ++rank) {
    for (size_t fact = 0; fact < digests[rank].size(); ++fact) {
      if (digests[rank][fact] != digests[0][fact]) {
        return FactMismatch{static_cast<int>(rank), static_cast<int>(fact)};
      }
    }
  }
  return std::nullopt;
}

std::string FirstDifference(const std::string& reference, const std::string& other,
                            int other_rank) {
  const std::vector<absl::string_view> a = absl::StrSplit(reference, '\n');
  const std::vector<absl::string_view> b = absl::StrSplit(other, '\n');
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    const bool in_a = i < a.size();
    const bool in_b = i < b.size();
    if (in_a && in_b && a[i] == b[i]) continue;
    return absl::StrCat("rank 0 has ", in_a ? Shown(a[i]) : "nothing more", ", rank ", other_rank,
                        " has ", in_b ? Shown(b[i]) : "nothing more");
  }
  return "the values are equal";  // digests differed but the texts do not: not expected
}

absl::Status CheckSameOnAllRanks(Communicator& world, const std::vector<JobFact>& facts,
                                 absl::Duration quiet_wait) {
  if (world.size() == 1) return absl::OkStatus();
  const int64_t num_facts = static_cast<int64_t>(facts.size());
  at::Tensor mine = at::empty({num_facts, kDigestChars}, at::kByte);
  for (int64_t i = 0; i < num_facts; ++i) {
    const std::string digest = c10::sha1(facts[i].value).str();
    std::memcpy(mine[i].data_ptr(), digest.data(), kDigestChars);
  }
  at::Tensor all = at::empty({world.size() * num_facts, kDigestChars}, at::kByte);
  world.AllGather(mine, all)->WaitOrThrow();
  std::vector<std::vector<std::string>> digests(world.size());
  for (int rank = 0; rank < world.size(); ++rank) {
    for (int64_t i = 0; i < num_facts; ++i) {
      digests[rank].emplace_back(static_cast<const char*>(all[rank * num_facts + i].data_ptr()),
                                 kDigestChars);
    }
  }
  const std::optional<FactMismatch> mismatch = FindMismatch(digests);
  if (!mismatch.has_value()) return absl::OkStatus();
  const JobFact& fact = facts[mismatch->fact_idx];
  const std::vector<std::string> values = GatherValues(world, fact.value);
  const absl::Status status = absl::FailedPreconditionError(absl::StrCat(
      "start-up check: rank ", mismatch->rank, " of ", world.size(), " differs from rank 0 in the ",
      fact.name, ": ", FirstDifference(values[0], values[mismatch->rank], mismatch->rank),
      "; every rank must run the same moefit build on the same config and checkpoint"));
  if (world.rank() != 0) absl::SleepFor(quiet_wait);
  return status;
}

}  // namespace moefit::parallel
