// MPI plumbing shared by the MPI runtime and the MPI communicator: how
// MOEFIT_CHECK_FOREIGN reads MPI return codes, the int-count limit, and the
// datatypes tensors travel as.
//
// MPI (3.1, what Open MPI 4 implements) counts and displaces in `int`. Rows
// therefore travel as one derived datatype per row, so the limit applies to
// rows rather than bytes; anything still above INT_MAX fails with a message
// that names the operation, the peer and the value instead of wrapping around.
#pragma once

#include <c10/core/ScalarType.h>
#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "parallel/foreign_check.h"

namespace moefit::parallel {

// MPI functions return int; no other library moefit checks returns a plain int.
template <>
struct ForeignCode<int> {
  static constexpr const char* kLibrary = "MPI";
  static bool Ok(int code) { return code == MPI_SUCCESS; }
  static std::string Describe(int code);
};

namespace internal {

// Per-peer counts and displacements (prefix sums) as MPI's int arrays.
struct MpiCounts {
  std::vector<int> counts;
  std::vector<int> displacements;
};

// Converts per-peer counts, in units of one MPI datatype, to MPI's int arrays.
// Fails with OutOfRange, naming `what` and the peer, when a count or a
// displacement exceeds INT_MAX.
absl::StatusOr<MpiCounts> ToMpiCounts(absl::Span<const int64_t> counts, absl::string_view what);

// The predefined MPI type for reducing `dtype` element-wise (reductions need
// the real type, not bytes). bf16 and fp16 have none: callers stage them in
// fp32 (see MpiCommunicator::AllReduce). Throws c10::Error for other types.
MPI_Datatype ReductionDatatype(c10::ScalarType dtype);

// The widest unsigned MPI integer type (8, 4, 2 or 1 bytes) whose size divides
// `num_bytes`: the unit in which a block of num_bytes travels as raw data.
MPI_Datatype CopyUnit(int64_t num_bytes, int64_t* unit_bytes);

// A committed contiguous datatype of `num_bytes` (one tensor row), freed on
// destruction. MPI allows freeing a datatype while operations posted with it
// are still pending.
class ScopedRowType {
 public:
  ScopedRowType() = default;
  ~ScopedRowType();
  ScopedRowType(const ScopedRowType&) = delete;
  ScopedRowType& operator=(const ScopedRowType&) = delete;

  // num_bytes > 0; fails if a row is more than INT_MAX units.
  absl::Status Init(int64_t num_bytes, absl::string_view what);
  MPI_Datatype get() const { return type_; }

 private:
  absl::Status Free();

  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

}  // namespace internal
}  // namespace moefit::parallel
