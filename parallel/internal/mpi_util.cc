// MPI plumbing shared by the MPI runtime and communicator (see the header).
#include "parallel/internal/mpi_util.h"

#include <c10/util/Exception.h>

#include <climits>
#include <cstdio>

#include "absl/strings/str_cat.h"

namespace moefit::parallel {

std::string ForeignCode<int>::Describe(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    return absl::StrCat("MPI error code ", code);
  return absl::StrCat(absl::string_view(text, length), " (MPI error code ", code, ")");
}

namespace internal {

absl::StatusOr<MpiCounts> ToMpiCounts(absl::Span<const int64_t> counts, absl::string_view what) {
  MpiCounts result;
  result.counts.reserve(counts.size());
  result.displacements.reserve(counts.size());
  int64_t offset = 0;
  for (size_t peer_idx = 0; peer_idx < counts.size(); ++peer_idx) {
    const int64_t count = counts[peer_idx];
    if (count < 0 || count > INT_MAX) {
      return absl::OutOfRangeError(absl::StrCat(what, ": count for rank ", peer_idx, " is ", count,
                                                "; MPI counts are int (0..", INT_MAX, ")"));
    }
    if (offset > INT_MAX) {
      return absl::OutOfRangeError(absl::StrCat(
          what, ": displacement of rank ", peer_idx, " is ", offset, ", above INT_MAX (", INT_MAX,
          "), which MPI displacements cannot express; send fewer rows per call"));
    }
    result.counts.push_back(static_cast<int>(count));
    result.displacements.push_back(static_cast<int>(offset));
    offset += count;
  }
  return result;
}

MPI_Datatype ReductionDatatype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return MPI_FLOAT;
    case c10::ScalarType::Double:
      return MPI_DOUBLE;
    case c10::ScalarType::Long:
      return MPI_INT64_T;
    case c10::ScalarType::Int:
      return MPI_INT32_T;
    case c10::ScalarType::Short:
      return MPI_INT16_T;
    case c10::ScalarType::Char:
      return MPI_INT8_T;
    case c10::ScalarType::Byte:
      return MPI_UINT8_T;
    default:
      TORCH_CHECK(false, "MPI has no reduction datatype for ", dtype);
  }
}

MPI_Datatype CopyUnit(int64_t num_bytes, int64_t* unit_bytes) {
  if (num_bytes % 8 == 0) {
    *unit_bytes = 8;
    return MPI_UINT64_T;
  }
  if (num_bytes % 4 == 0) {
    *unit_bytes = 4;
    return MPI_UINT32_T;
  }
  if (num_bytes % 2 == 0) {
    *unit_bytes = 2;
    return MPI_UINT16_T;
  }
  *unit_bytes = 1;
  return MPI_UINT8_T;
}

ScopedRowType::~ScopedRowType() {
  const absl::Status status = Free();
  if (!status.ok())
    std::fprintf(stderr, "moefit: freeing an MPI datatype: %s\n", status.ToString().c_str());
}

absl::Status ScopedRowType::Free() {
  if (type_ == MPI_DATATYPE_NULL) return absl::OkStatus();
  int finalized = 0;
  MOEFIT_CHECK_FOREIGN(MPI_Finalized(&finalized));
  if (!finalized) MOEFIT_CHECK_FOREIGN(MPI_Type_free(&type_));
  return absl::OkStatus();
}

absl::Status ScopedRowType::Init(int64_t num_bytes, absl::string_view what) {
  int64_t unit_bytes = 1;
  const MPI_Datatype unit = CopyUnit(num_bytes, &unit_bytes);
  const int64_t num_units = num_bytes / unit_bytes;
  if (num_units > INT_MAX) {
    return absl::OutOfRangeError(absl::StrCat(what, ": one row is ", num_bytes,
                                              " bytes, more than MPI's int count can describe"));
  }
  MOEFIT_CHECK_FOREIGN(MPI_Type_contiguous(static_cast<int>(num_units), unit, &type_));
  MOEFIT_CHECK_FOREIGN(MPI_Type_commit(&type_));
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace moefit::parallel
