// The project's status-propagation macros (Abseil 20220623 has none).
//
// They live in the lowest module, next to the schemas, because every module
// that does I/O (checkpoint, launch, ...) already depends on it.
//
//   MOEFIT_RETURN_IF_ERROR(expr);            // expr yields absl::Status
//   MOEFIT_ASSIGN_OR_RETURN(lhs, expr);      // expr yields absl::StatusOr<T>
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MOEFIT_STATUS_CONCAT_INNER(a, b) a##b
#define MOEFIT_STATUS_CONCAT(a, b) MOEFIT_STATUS_CONCAT_INNER(a, b)

#define MOEFIT_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    const ::absl::Status moefit_status_ = (expr);    \
    if (!moefit_status_.ok()) return moefit_status_; \
  } while (false)

#define MOEFIT_ASSIGN_OR_RETURN(lhs, expr) \
  MOEFIT_ASSIGN_OR_RETURN_IMPL(MOEFIT_STATUS_CONCAT(moefit_statusor_, __LINE__), lhs, expr)

#define MOEFIT_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(*tmp)
