// MPI start/finish and AbortAll (see the header for why they are shaped so).
#include "parallel/mpi_runtime.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "parallel/internal/mpi_util.h"
#include "parallel/watchdog.h"

namespace moefit::parallel {
namespace {

// Exit code for an exception that escaped to std::terminate.
constexpr int kTerminateExitCode = 134;

// How long MPI_Abort gets to end the job before the aborting process exits by
// itself (well inside the watchdog's bound of timeout + 15 s).
constexpr std::chrono::seconds kAbortExitAfter{10};

std::atomic<bool> abort_started{false};

const char* ThreadLevelName(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
  }
  return "unknown thread level";
}

[[noreturn]] void AbortOnTerminate() {
  std::string reason = "std::terminate called without an active exception";
  if (const std::exception_ptr current = std::current_exception()) {
    try {
      std::rethrow_exception(current);
    } catch (const std::exception& error) {
      reason = absl::StrCat("uncaught exception: ", error.what());
    } catch (...) {
      reason = "uncaught exception of a type not derived from std::exception";
    }
  }
  AbortAll(kTerminateExitCode, reason);
}

absl::Status Finalize() {
  int finalized = 0;
  MOEFIT_CHECK_FOREIGN(MPI_Finalized(&finalized));
  if (!finalized) MOEFIT_CHECK_FOREIGN(MPI_Finalize());
  return absl::OkStatus();
}

// Whether MPI is running (started, not finished), and this process's place in
// MPI_COMM_WORLD if so. Safe from any thread at any time.
absl::Status QueryWorld(bool* mpi_running, int* world_rank, int* world_size) {
  int initialized = 0;
  int finalized = 0;
  MOEFIT_CHECK_FOREIGN(MPI_Initialized(&initialized));
  MOEFIT_CHECK_FOREIGN(MPI_Finalized(&finalized));
  *mpi_running = initialized && !finalized;
  if (!*mpi_running) return absl::OkStatus();
  MOEFIT_CHECK_FOREIGN(MPI_Comm_rank(MPI_COMM_WORLD, world_rank));
  MOEFIT_CHECK_FOREIGN(MPI_Comm_size(MPI_COMM_WORLD, world_size));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<MpiRuntime>> MpiRuntime::Start(int* argc, char*** argv,
                                                              const MpiRuntimeOptions& options) {
  int finalized = 0;
  MOEFIT_CHECK_FOREIGN(MPI_Finalized(&finalized));
  if (finalized)
    return absl::FailedPreconditionError("MPI has already been finalized in this process");
  int initialized = 0;
  MOEFIT_CHECK_FOREIGN(MPI_Initialized(&initialized));
  int thread_level = MPI_THREAD_SINGLE;
  if (initialized) {
    MOEFIT_CHECK_FOREIGN(MPI_Query_thread(&thread_level));
  } else {
    MOEFIT_CHECK_FOREIGN(MPI_Init_thread(argc, argv, options.required_thread_level, &thread_level));
  }
  // Errors on MPI_COMM_WORLD come back as codes (and so as our messages)
  // rather than killing the process inside MPI; a world that another library
  // started keeps that library's handler.
  if (!initialized)
    MOEFIT_CHECK_FOREIGN(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  int world_rank = 0;
  int world_size = 0;
  MOEFIT_CHECK_FOREIGN(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  MOEFIT_CHECK_FOREIGN(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  if (thread_level < options.required_thread_level) {
    return absl::FailedPreconditionError(
        absl::StrCat("MPI provides ", ThreadLevelName(thread_level), ", but ",
                     ThreadLevelName(options.required_thread_level), " is required"));
  }
  if (options.abort_on_terminate) std::set_terminate(AbortOnTerminate);
  return std::unique_ptr<MpiRuntime>(
      new MpiRuntime(!initialized, world_rank, world_size, thread_level));
}

MpiRuntime::MpiRuntime(bool owns_mpi, int world_rank, int world_size, int thread_level)
    : owns_mpi_(owns_mpi),
      world_rank_(world_rank),
      world_size_(world_size),
      thread_level_(thread_level) {}

MpiRuntime::~MpiRuntime() {
  if (!owns_mpi_) return;
  absl::Status status;
  {
    // MPI_Finalize waits for the other ranks in some MPIs: a rank that never
    // arrives must not hang this one.
    WatchdogScope watch("MPI_Finalize");
    status = Finalize();
  }
  if (!status.ok())
    std::fprintf(stderr, "moefit: rank %d: %s\n", world_rank_, status.ToString().c_str());
}

void AbortAll(int exit_code, std::string_view reason) {
  if (exit_code == 0) exit_code = 1;
  if (abort_started.exchange(true)) {
    // Another thread is already tearing the job down; let it, but never return
    // and never hang if it somehow fails to.
    std::this_thread::sleep_for(std::chrono::seconds(10));
    std::_Exit(exit_code);
  }
  bool mpi_running = false;
  int world_rank = -1;
  int world_size = -1;
  const absl::Status query = QueryWorld(&mpi_running, &world_rank, &world_size);
  std::string line =
      absl::StrCat("moefit: rank ", world_rank, " of ", world_size, " aborting the job (exit code ",
                   exit_code, "): ", absl::string_view(reason.data(), reason.size()), "\n");
  if (!query.ok()) absl::StrAppend(&line, "moefit: while aborting: ", query.ToString(), "\n");
  std::fflush(stdout);
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
  if (mpi_running) {
    // MPI_Abort asks mpirun to end every rank; if this host has lost contact
    // with mpirun, that request may never arrive nor the call return. Then
    // this process at least ends by itself, non-zero, a little later.
    try {
      std::thread([exit_code] {
        std::this_thread::sleep_for(kAbortExitAfter);
        std::_Exit(exit_code);
      }).detach();
    } catch (const std::system_error&) {
      // No thread to be had: then MPI_Abort alone.
    }
    // Its code is not checked: there is nothing left to report it to.
    MPI_Abort(MPI_COMM_WORLD, exit_code);
  }
  std::_Exit(exit_code);
}

}  // namespace moefit::parallel
