// The one macro through which moefit checks return codes of foreign C libraries
// (MPI, NCCL, CUDA runtime).
//
// Those libraries report failure as an integer or enum that is easy to drop on
// the floor, and their own messages never say which of our calls failed. The
// macro turns a failing code into an absl::Status that carries the library, the
// function called, our file:line and the library's own description, and
// returns it from the enclosing function (which therefore returns absl::Status
// or absl::StatusOr<T>):
//
//   MOEFIT_CHECK_FOREIGN(MPI_Comm_dup(base, &comm));
//   // -> "MPI_Comm_dup failed at parallel/mpi_communicator.cc:97: MPI_ERR_COMM: invalid
//   communicator"
//
// Each library teaches the macro its codes by specialising ForeignCode<Code>
// next to the code that calls it (MPI: parallel/internal/mpi_util.h; NCCL and
// CUDA: parallel/nccl_communicator.cc), so this header includes none of them.
// Destructors, which cannot return a status, call a small helper that returns
// one and log it.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace moefit::parallel {

// Specialise for a library's return-code type with:
//   static constexpr const char* kLibrary;        // "MPI", "NCCL", "CUDA"
//   static bool Ok(Code code);                    // success?
//   static std::string Describe(Code code);       // the library's own words
template <typename Code>
struct ForeignCode;

namespace internal {

// "/src/moefit/parallel/mpi_communicator.cc" -> "parallel/mpi_communicator.cc":
// enough to find the line, short enough to read in a log of many ranks.
inline absl::string_view ShortSourcePath(absl::string_view path) {
  const size_t last = path.rfind('/');
  if (last == absl::string_view::npos || last == 0) return path;
  const size_t second = path.rfind('/', last - 1);
  return second == absl::string_view::npos ? path : path.substr(second + 1);
}

// "MPI_Comm_dup(base, &comm)" -> "MPI_Comm_dup": the arguments are in the
// source at the reported line; the message stays one readable line.
inline absl::string_view CalledFunction(absl::string_view call) {
  return call.substr(0, call.find('('));
}

template <typename Code>
absl::Status ForeignCallStatus(Code code, absl::string_view call, absl::string_view file,
                               int line) {
  using Traits = ForeignCode<Code>;
  if (Traits::Ok(code)) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(Traits::kLibrary, " call ", CalledFunction(call),
                                          " failed at ", ShortSourcePath(file), ":", line, ": ",
                                          Traits::Describe(code)));
}

}  // namespace internal
}  // namespace moefit::parallel

// Evaluates `call` once; if the foreign code it returns is not success, returns
// the resulting absl::Status (kInternal, naming call and file:line) from the
// enclosing function.
#define MOEFIT_CHECK_FOREIGN(call)                                                          \
  do {                                                                                      \
    ::absl::Status moefit_foreign_status =                                                  \
        ::moefit::parallel::internal::ForeignCallStatus((call), #call, __FILE__, __LINE__); \
    if (!moefit_foreign_status.ok()) return moefit_foreign_status;                          \
  } while (false)
