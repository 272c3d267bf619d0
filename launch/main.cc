// The `moefit` command line: a small subcommand dispatcher; each command's
// flags are Abseil flags. Exit codes: 0 success, 1 runtime failure, 2 bad
// input (usage, config, data), each with one message naming what was wrong.
#include <ATen/Parallel.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "experts/registry.h"
#include "framework/families/family.h"
#include "google/protobuf/text_format.h"
#include "launch/config.h"
#include "parallel/dispatcher.h"
#include "launch/inspect_command.h"
#include "launch/train_command.h"
#include "parallel/local_communicator.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_runtime.h"

ABSL_FLAG(bool, print_config, false,
          "print the resolved config (text format, after --set and config_json) and exit");

namespace moefit::launch {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitBadInput = 2;

std::string Usage() {
  std::vector<std::string> families;
  for (const auto& f : framework::ModelFamilies()) families.push_back(f.name);
  return "usage: moefit <command> [args]\n"
         "\n"
         "commands:\n"
         "  train [CONFIG] [--set FIELD=VALUE]... [--print_config]\n"
         "      Train a MoE model. CONFIG is a training config in protobuf text format\n"
         "      (proto/config.proto); without it, the built-in demo runs: a tiny\n"
         "      Qwen3-MoE-shaped model on the English corpus shipped with moefit.\n"
         "      --set overrides any field, e.g. --set optimizer.lr=3e-4 --set train.steps=20;\n"
         "      repeated fields take a list: --set model.mlp_only_layers=[0,3].\n"
         "      model.config_json: PATH reads the model shape from a Hugging Face config.json.\n"
         "  inspect DIR|FILE\n"
         "      List what a checkpoint holds (a .safetensors file, or a model directory with\n"
         "      config.json): tensors grouped by name pattern, dtypes, shapes, total and active\n"
         "      parameter counts, the MoE layout.\n"
         "  help      this text\n"
         "  version   print the version\n"
         "\n"
         "model families: " +
         absl::StrJoin(families, ", ") +
         "\n"
         "expert backends: " +
         absl::StrJoin(experts::ExpertBackendNames(), ", ") +
         "\n"
         "expert parallelism: mpirun -np N moefit train ... spreads the experts over N\n"
         "      processes (parallel.ep_size, parallel.dispatcher: " +
         absl::StrJoin(parallel::DispatcherNames(), ", ") +
         ").\n"
         "environment: MOEFIT_NUM_THREADS sets the CPU threads of this process.\n"
         "exit codes: 0 ok, 1 runtime failure, 2 bad input.\n";
}

bool LaunchedByMpirun() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

int ExitCodeFor(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return kExitBadInput;
    default:
      return kExitFailure;
  }
}

int Fail(const absl::Status& s) {
  std::cerr << "moefit: " << s.message() << std::endl;
  return ExitCodeFor(s);
}

// Separates repeated `--set X` / `--set=X` (which Abseil flags cannot
// accumulate) from the rest, and rejects flags this binary does not define.
bool SplitArgs(int argc, char** argv, std::vector<std::string>* sets,
               std::vector<char*>* rest, bool* help) {
  rest->push_back(argv[0]);
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      *help = true;
    } else if (a == "--set") {
      if (i + 1 >= argc) {
        std::cerr << "moefit: --set needs FIELD=VALUE" << std::endl;
        return false;
      }
      sets->push_back(argv[++i]);
    } else if (absl::StartsWith(a, "--set=")) {
      sets->push_back(a.substr(6));
    } else if (absl::StartsWith(a, "-") && a != "-" && a != "--") {
      std::string name = a.substr(a.find_first_not_of('-'));
      name = name.substr(0, name.find('='));
      if (absl::FindCommandLineFlag(name) == nullptr &&
          !(absl::StartsWith(name, "no") && absl::FindCommandLineFlag(name.substr(2)))) {
        std::cerr << "moefit: unknown flag '" << a << "' (see moefit --help)" << std::endl;
        return false;
      }
      rest->push_back(argv[i]);
    } else {
      rest->push_back(argv[i]);
    }
  }
  return true;
}

int TrainMain(int argc, char** argv) {
  std::vector<std::string> sets;
  std::vector<char*> rest;
  bool help = false;
  if (!SplitArgs(argc, argv, &sets, &rest, &help)) return kExitBadInput;
  if (help) {
    std::cout << Usage();
    return kExitOk;
  }
  std::vector<char*> positional = absl::ParseCommandLine(static_cast<int>(rest.size()), rest.data());
  if (positional.size() > 2) {
    std::cerr << "moefit: train takes at most one CONFIG, got '" << positional[2] << "'"
              << std::endl;
    return kExitBadInput;
  }
  const std::string config_path = positional.size() == 2 ? positional[1] : "";
  absl::StatusOr<proto::Config> config = LoadConfig(config_path, sets);
  if (!config.ok()) return Fail(config.status());
  if (absl::GetFlag(FLAGS_print_config)) {
    std::string text;
    google::protobuf::TextFormat::PrintToString(*config, &text);
    std::cout << text;
    return kExitOk;
  }
  absl::StatusOr<RunConfig> run = ResolveConfig(*config);
  if (!run.ok()) return Fail(run.status());

  // Under mpirun every rank joins MPI's world; alone, the process is a world
  // of one and needs no MPI at all.
  std::unique_ptr<parallel::MpiRuntime> mpi;
  std::shared_ptr<parallel::Communicator> world;
  if (LaunchedByMpirun()) {
    auto started = parallel::MpiRuntime::Start(&argc, &argv);
    if (!started.ok()) return Fail(started.status());
    mpi = std::move(*started);
    auto comm = parallel::MpiCommunicator::Create(MPI_COMM_WORLD);
    if (!comm.ok()) return Fail(comm.status());
    world = std::move(*comm);
  } else {
    world = parallel::LocalCommunicator::Create("world");
  }
  absl::Status s;
  try {
    s = RunTraining(*run, world, std::cout);
  } catch (const std::exception& e) {
    s = absl::InternalError(e.what());
  }
  if (!s.ok() && world->size() > 1) {
    // The other ranks may be waiting in a collective: end them all, now.
    parallel::AbortAll(ExitCodeFor(s), absl::StrCat("rank ", world->rank(), ": ", s.message()));
  }
  return s.ok() ? kExitOk : Fail(s);
}

int Main(int argc, char** argv) {
  if (const char* t = std::getenv("MOEFIT_NUM_THREADS"); t != nullptr && std::atoi(t) > 0) {
    at::set_num_threads(std::atoi(t));
  }
  if (argc < 2) {
    std::cerr << Usage();
    return kExitBadInput;
  }
  const std::string cmd = argv[1];
  if (cmd == "help" || cmd == "--help" || cmd == "-h") {
    std::cout << Usage();
    return kExitOk;
  }
  if (cmd == "version" || cmd == "--version") {
    std::cout << "moefit " << MOEFIT_VERSION << std::endl;
    return kExitOk;
  }
  if (cmd == "train") return TrainMain(argc, argv);
  if (cmd == "inspect") {
    if (argc != 3 || absl::StartsWith(argv[2], "-")) {
      if (argc == 3 && (std::strcmp(argv[2], "--help") == 0 || std::strcmp(argv[2], "-h") == 0)) {
        std::cout << Usage();
        return kExitOk;
      }
      std::cerr << "moefit: usage: moefit inspect DIR|FILE" << std::endl;
      return kExitBadInput;
    }
    absl::Status s = RunInspect(argv[2], std::cout);
    return s.ok() ? kExitOk : Fail(s);
  }
  std::cerr << "moefit: unknown command '" << cmd << "' (see moefit --help)" << std::endl;
  return kExitBadInput;
}

}  // namespace
}  // namespace moefit::launch

int main(int argc, char** argv) {
  try {
    return moefit::launch::Main(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "moefit: " << e.what() << std::endl;
    return 1;
  }
}
