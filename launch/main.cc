// The `moefit` command line: a small subcommand dispatcher; each command's
// flags are Abseil flags (`--save-logits` and `--save_logits` both work).
// Exit codes: 0 success, 1 runtime failure, 2 bad input (usage, config, data,
// checkpoint, ranks that disagree at start-up), each with one message naming
// what was wrong; `plan` exits 3 when the model does not fit the cluster; 124
// when a collective did not finish in time (parallel/watchdog.h). Under mpirun
// every command runs collectively, and any rank's failure ends every rank.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "experts/kernels/isa.h"
#include "experts/registry.h"
#include "framework/families/family.h"
#include "framework/host_allocator.h"
#include "google/protobuf/text_format.h"
#include "launch/config.h"
#include "launch/eval_command.h"
#include "launch/expert_map_command.h"
#include "launch/export_command.h"
#include "launch/inspect_command.h"
#include "launch/merge_command.h"
#include "launch/plan_command.h"
#include "launch/reshard_command.h"
#include "launch/routing_report_command.h"
#include "launch/startup_check.h"
#include "launch/train_command.h"
#include "parallel/dispatcher.h"
#include "parallel/fault_injection.h"
#include "parallel/local_communicator.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_progress.h"
#include "parallel/mpi_runtime.h"
#include "parallel/watchdog.h"
#include "proto/status_macros.h"

ABSL_FLAG(bool, print_config, false,
          "print the resolved config (text format, after --set and config_json) and exit");
ABSL_FLAG(int64_t, eval_sequences, 64, "eval: number of sequences of the data to evaluate");
ABSL_FLAG(std::string, save_logits, "", "eval: write the logits for --input_ids to this file");
ABSL_FLAG(std::string, input_ids, "",
          "eval: safetensors file holding \"input_ids\" [batch, tokens]");
ABSL_FLAG(std::optional<int64_t>, max_shard_bytes, std::nullopt,
          "export, merge: largest shard in bytes (default: checkpoint.max_shard_bytes's)");
ABSL_FLAG(std::string, save_dtype, "",
          "export, merge: dtype of the written weights (float32, bfloat16)");
// plan: the cluster and the run; the four sizes of the cluster are required (0 = not given).
ABSL_FLAG(std::string, model, "", "plan: HF config.json of the model");
ABSL_FLAG(int64_t, nodes, 0, "plan: number of nodes");
ABSL_FLAG(double, ram_gb, 0, "plan: host RAM per node, GiB");
ABSL_FLAG(int64_t, gpus_per_node, 0, "plan: GPUs per node");
ABSL_FLAG(double, gpu_gb, 0, "plan: memory per GPU, GiB");
ABSL_FLAG(std::string, mode, "full", "plan: full (train every weight) or lora (adapters only)");
ABSL_FLAG(int64_t, lora_rank, 16, "plan: LoRA rank");
ABSL_FLAG(std::string, expert_dtype, "bf16",
          "plan: routed experts' dtype: fp32, bf16, fp8 or int4");
ABSL_FLAG(int64_t, int4_group_size, 0,
          "plan: int4 experts' inputs per scale (0: the model config's quantization_config, "
          "else 32)");
ABSL_FLAG(double, packed_weight_gb, 2,
          "plan: GiB of expert packs each process keeps (experts.packed_weight_gb)");
ABSL_FLAG(std::string, cpu_isa, "amx_bf16",
          "plan: the nodes' expert kernels: avx2, avx512, avx512_bf16 or amx_bf16");
ABSL_FLAG(int64_t, seq_len, 4096, "plan: tokens per sequence");
ABSL_FLAG(int64_t, micro_batch, 1, "plan: sequences per GPU per micro-batch");
ABSL_FLAG(bool, json, false, "plan: print one JSON object instead of text");
ABSL_FLAG(int32_t, ep, 0, "reshard: expert-parallel ranks of the output");
ABSL_FLAG(int64_t, sequences, 256, "routing-report: sequences per data source, at most");
ABSL_FLAG(int64_t, bootstrap, 1000, "routing-report: bootstrap resamples");
ABSL_FLAG(double, confidence, 0.95, "routing-report: confidence of the intervals");
ABSL_FLAG(int64_t, top, 5, "routing-report: experts listed per source");
ABSL_FLAG(std::string, json_out, "", "routing-report: write every figure to this JSON file");
ABSL_FLAG(int64_t, step, 0, "expert-map: the step to draw (0 = the last in the metrics file)");
ABSL_FLAG(std::string, out, "", "expert-map: the PNG file to write (default: beside the metrics)");

namespace moefit::launch {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitBadInput = 2;
constexpr int kExitDoesNotFit = 3;  // plan

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
         "      model.model_path: DIR starts from a Hugging Face model directory's weights;\n"
         "      checkpoint.save_dir: DIR writes the trained model there in the same format.\n"
         "      Training checkpoints: --set checkpoint.save_every_steps=N writes DIR/step-*\n"
         "      (and the model to DIR/final); --set checkpoint.resume_from=latest resumes,\n"
         "      at any number of processes. SIGTERM/SIGINT then save and exit 0.\n"
         "      LoRA: --set train.mode=lora --set lora.rank=16 --set lora.target_modules=[q_proj,\n"
         "      v_proj,experts] trains adapters on a frozen base and saves a PEFT adapter.\n"
         "      train.recompute: none|experts|full trades compute for activation memory.\n"
         "  eval [CONFIG] [--set FIELD=VALUE]... [--eval_sequences N]\n"
         "       [--save_logits OUT.safetensors --input_ids IN.safetensors]\n"
         "      (--set lora.adapter_path=DIR evaluates the model with a PEFT adapter)\n"
         "      Loss and perplexity of the model on the first N sequences of the data, or\n"
         "      the logits for the given input ids, to compare with another implementation.\n"
         "  inspect DIR|FILE\n"
         "      List what a checkpoint holds (a .safetensors file, or a model directory with\n"
         "      config.json): tensors grouped by name pattern, dtypes, shapes, total and active\n"
         "      parameter counts, the MoE layout.\n"
         "  export SRC_DIR DST_DIR [--max_shard_bytes N] [--save_dtype float32|bfloat16]\n"
         "      Rewrite a model directory in the standard Hugging Face layout (per-expert\n"
         "      tensors, sharded safetensors, index), from any layout its family reads; or\n"
         "      write the model of a training checkpoint (checkpoint.save_dir/step-*) that way\n"
         "      (a PEFT adapter directory for a train.mode=lora run).\n"
         "  merge BASE_DIR ADAPTER_DIR OUT_DIR [--max_shard_bytes N] [--save_dtype D]\n"
         "      Fold a LoRA adapter (PEFT format, e.g. the checkpoint.save_dir of a\n"
         "      train.mode=lora run) into its base model and write the merged model as a\n"
         "      Hugging Face model directory (in the base's dtype unless --save_dtype).\n"
         "  reshard IN_DIR OUT_DIR --ep M\n"
         "      Rewrite the training checkpoint IN_DIR (a checkpoint.save_dir/step-* directory)\n"
         "      as saved by M expert-parallel ranks, without building the model; under mpirun\n"
         "      the processes share the expert files.\n"
         "  plan --model CONFIG_JSON --nodes N --ram-gb R --gpus-per-node G --gpu-gb M\n"
         "       [--mode full|lora] [--lora-rank r] [--expert-dtype fp32|bf16|fp8|int4]\n"
         "       [--int4-group-size G4] [--packed-weight-gb P] [--cpu-isa ISA]\n"
         "       [--seq-len T] [--micro-batch B] [--json]\n"
         "      Whether the model of an HF config.json trains on N nodes of R GiB RAM and\n"
         "      G GPUs of M GiB each (experts in host RAM, num_experts/N per node; the dense\n"
         "      part replicated on every GPU, B x T tokens each), without building it: host\n"
         "      RAM per node (expert weights, gradients, AdamW m and v, LoRA adapters, the\n"
         "      expert kernels' kept packs: up to P GiB for each of the G processes, sized\n"
         "      for ISA's kernels; activations: T*B*G*top_k rows x MoE layers x\n"
         "      (hidden + 2*moe_intermediate) elements), memory per GPU, all-to-all bytes\n"
         "      per node and micro-batch (4 x MoE layers x (N-1)/N x rows x hidden\n"
         "      elements), total and active parameters, the smallest node count that fits,\n"
         "      and its assumptions. Defaults: full, rank 16, bf16, P 2, amx_bf16, T 4096,\n"
         "      B 1. fp8 and int4 experts need --mode lora; int4 has a bf16 scale per G4\n"
         "      inputs (default: the config's quantization_config, else 32).\n"
         "      Exit 0 fits, 3 does not fit, 2 bad input.\n"
         "  routing-report [CONFIG] --data A --data B ... [--set FIELD=VALUE]...\n"
         "       [--sequences N] [--bootstrap B] [--confidence C] [--top K] [--json-out FILE]\n"
         "      Which experts each data source uses (A, B: .jsonl of {\"input_ids\": [...]}, a\n"
         "      sequence per line, or text through the byte tokenizer): each expert's share of\n"
         "      a source's tokens with bootstrap intervals over its sequences, against a control\n"
         "      (the same tokens shuffled within each sequence); the experts that take more of\n"
         "      a source than of every other, measured. Defaults: 256 sequences, 1000\n"
         "      resamples, 95%, top 5.\n"
         "  expert-map RUN_DIR [--step N] [--out FILE.png]\n"
         "      Draw the expert map of a run again from its metrics file (RUN_DIR: the file,\n"
         "      or the directory holding it): MoE layers x experts, each expert coloured by\n"
         "      its decayed load relative to its layer's mean (blue below, white at, red\n"
         "      above, up to 8x), the hot experts (2x the mean) outlined, as training draws\n"
         "      it with logging.expert_map_every_steps. Default: the last step, written to\n"
         "      expert-map.png beside the metrics file.\n"
         "  help      this text\n"
         "  version   print the version\n"
         "\n"
         "model families: " +
         absl::StrJoin(families, ", ") +
         "\n"
         "expert backends: " +
         absl::StrJoin(experts::ExpertBackendNames(), ", ") +
         "\n"
         "expert parallelism: mpirun -np N moefit <command> ... spreads the experts over N\n"
         "      processes (parallel.ep_size, parallel.dispatcher: " +
         absl::StrJoin(parallel::DispatcherNames(), ", ") +
         ").\n"
         "environment: MOEFIT_NUM_THREADS sets the CPU threads of this process;\n"
         "      MOEFIT_CPU_ISA (portable, avx2, avx512, avx512_bf16, amx_bf16) caps the\n"
         "      instruction set of the expert kernels (default: the widest this CPU has;\n"
         "      avx512_bf16 widens bfloat16 weights to float32 where this CPU's vdpbf16ps\n"
         "      is slower, as `moefit train` prints);\n"
         "      MOEFIT_HOST_ALLOCATOR=system takes LibTorch's default host allocator instead\n"
         "      of moefit's caching one.\n"
         "exit codes: 0 ok, 1 runtime failure, 2 bad input, 3 does not fit (plan),\n"
         "      124 a collective did not finish within parallel.timeout_s (or\n"
         "      parallel.startup_timeout_s outside training steps): a rank stalled, crashed\n"
         "      or was cut off.\n";
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

struct Args {
  std::vector<std::string> sets;
  std::vector<std::string> data;  // routing-report's repeated --data
  std::vector<std::string> positional;
  bool help = false;
};

// Separates repeated `--set X` / `--set=X` (which Abseil flags cannot
// accumulate), accepts dashes for underscores in flag names, rejects flags the
// command does not take, and hands the rest to Abseil.
bool ParseArgs(int argc, char** argv, const std::set<std::string>& allowed, Args* out) {
  std::vector<std::string> rest_storage = {argv[0]};
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      out->help = true;
    } else if (a == "--set" && allowed.count("set")) {
      if (i + 1 >= argc) {
        std::cerr << "moefit: --set needs FIELD=VALUE" << std::endl;
        return false;
      }
      out->sets.push_back(argv[++i]);
    } else if (absl::StartsWith(a, "--set=") && allowed.count("set")) {
      out->sets.push_back(a.substr(6));
    } else if (a == "--data" && allowed.count("data")) {
      if (i + 1 >= argc) {
        std::cerr << "moefit: --data needs FILE" << std::endl;
        return false;
      }
      out->data.push_back(argv[++i]);
    } else if (absl::StartsWith(a, "--data=") && allowed.count("data")) {
      out->data.push_back(a.substr(7));
    } else if (absl::StartsWith(a, "-") && a != "-") {
      const size_t dashes = a.find_first_not_of('-');
      const size_t eq = a.find('=');
      std::string name = absl::StrReplaceAll(
          a.substr(dashes, eq == std::string::npos ? eq : eq - dashes), {{"-", "_"}});
      const std::string base =
          absl::StartsWith(name, "no") && !allowed.count(name) ? name.substr(2) : name;
      if (!allowed.count(base) || absl::FindCommandLineFlag(base) == nullptr) {
        std::cerr << "moefit: unknown flag '" << a << "' for " << argv[1] << " (see moefit --help)"
                  << std::endl;
        return false;
      }
      rest_storage.push_back("--" + name + (eq == std::string::npos ? "" : a.substr(eq)));
    } else {
      rest_storage.push_back(a);
    }
  }
  std::vector<char*> rest;
  for (std::string& s : rest_storage) rest.push_back(s.data());
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(rest.size()), rest.data());
  for (size_t i = 1; i < positional.size(); ++i) out->positional.emplace_back(positional[i]);
  return true;
}

// Runs `body` with MPI's world under mpirun, else a world of one; a failure on
// any rank of a multi-rank job ends all ranks. Under mpirun with
// progress_thread_us > 0, MPI runs at MPI_THREAD_MULTIPLE with a progress
// thread (parallel/mpi_progress.h).
int RunCollective(int* argc, char*** argv,
                  const std::function<absl::Status(std::shared_ptr<parallel::Communicator>)>& body,
                  int64_t progress_thread_us = 0) {
  std::unique_ptr<parallel::MpiRuntime> mpi;
  std::unique_ptr<parallel::MpiProgressThread> progress;  // stopped before MPI is finalized
  std::shared_ptr<parallel::Communicator> world;
  if (LaunchedByMpirun()) {
    parallel::MpiRuntimeOptions options;
    if (progress_thread_us > 0) options.required_thread_level = MPI_THREAD_MULTIPLE;
    auto started = parallel::MpiRuntime::Start(argc, argv, options);
    if (!started.ok()) {
      return Fail(
          progress_thread_us > 0
              ? absl::Status(started.status().code(),
                             absl::StrCat("parallel.progress_thread_us = ", progress_thread_us,
                                          ": ", started.status().message()))
              : started.status());
    }
    mpi = std::move(*started);
    auto comm = parallel::MpiCommunicator::Create(MPI_COMM_WORLD);
    if (!comm.ok()) return Fail(comm.status());
    world = std::move(*comm);
    if (progress_thread_us > 0) {
      auto thread = parallel::MpiProgressThread::Start(absl::Microseconds(progress_thread_us));
      if (!thread.ok()) parallel::AbortAll(kExitBadInput, thread.status().ToString());
      progress = std::move(*thread);
    }
  } else {
    world = parallel::LocalCommunicator::Create("world");
  }
  // Test-only (parallel/fault_injection.h); a spec that does not parse is bad input.
  absl::Status s = parallel::InstallFaultFromEnvironment(world->rank());
  try {
    if (s.ok()) s = body(world);
  } catch (const std::exception& e) {
    s = absl::InternalError(e.what());
  }
  if (!s.ok() && world->size() > 1) {
    // The other ranks may be waiting in a collective: end them all, now.
    parallel::AbortAll(ExitCodeFor(s), absl::StrCat("rank ", world->rank(), ": ", s.message()));
  }
  return s.ok() ? kExitOk : Fail(s);
}

// train and eval: [CONFIG] [--set ...] -> the resolved run config, or an
// exit code when there is nothing to run (bad input, or --print_config done).
std::variant<RunConfig, int> LoadRun(const Args& args, const char* cmd) {
  if (args.positional.size() > 1) {
    std::cerr << "moefit: " << cmd << " takes at most one CONFIG, got '" << args.positional[1]
              << "'" << std::endl;
    return kExitBadInput;
  }
  absl::StatusOr<proto::Config> config =
      LoadConfig(args.positional.empty() ? "" : args.positional[0], args.sets);
  if (!config.ok()) return Fail(config.status());
  if (absl::GetFlag(FLAGS_print_config)) {
    std::string text;
    google::protobuf::TextFormat::PrintToString(*config, &text);
    std::cout << text;
    return kExitOk;
  }
  absl::StatusOr<RunConfig> run = ResolveConfig(*config);
  if (!run.ok()) return Fail(run.status());
  return *std::move(run);
}

// plan: the flags into PlanInputs, then RunPlan; 0 fits, 3 does not.
int PlanCommand(const Args& args) {
  if (!args.positional.empty()) {
    std::cerr << "moefit: plan takes no positional argument, got '" << args.positional[0]
              << "' (the model is --model CONFIG_JSON)" << std::endl;
    return kExitBadInput;
  }
  PlanInputs in;
  in.nodes = absl::GetFlag(FLAGS_nodes);
  in.ram_gib = absl::GetFlag(FLAGS_ram_gb);
  in.gpus_per_node = absl::GetFlag(FLAGS_gpus_per_node);
  in.gpu_gib = absl::GetFlag(FLAGS_gpu_gb);
  in.lora_rank = absl::GetFlag(FLAGS_lora_rank);
  in.seq_len = absl::GetFlag(FLAGS_seq_len);
  in.micro_batch = absl::GetFlag(FLAGS_micro_batch);
  for (const auto& [flag, given] : std::vector<std::pair<const char*, bool>>{
           {"--model CONFIG_JSON", !absl::GetFlag(FLAGS_model).empty()},
           {"--nodes N", in.nodes != 0},
           {"--ram-gb R", in.ram_gib != 0},
           {"--gpus-per-node G", in.gpus_per_node != 0},
           {"--gpu-gb M", in.gpu_gib != 0}}) {
    if (!given) {
      std::cerr << "moefit: plan needs " << flag << " (see moefit --help)" << std::endl;
      return kExitBadInput;
    }
  }
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "full") {
    in.mode = PlanMode::kFull;
  } else if (mode == "lora") {
    in.mode = PlanMode::kLora;
  } else {
    std::cerr << "moefit: --mode = '" << mode << "' must be full or lora" << std::endl;
    return kExitBadInput;
  }
  const std::string dtype = absl::GetFlag(FLAGS_expert_dtype);
  const auto* named = std::find(std::begin(kPlanDtypeNames), std::end(kPlanDtypeNames), dtype);
  if (named != std::end(kPlanDtypeNames)) {
    in.expert_dtype = static_cast<PlanDtype>(named - std::begin(kPlanDtypeNames));
  } else {
    std::cerr << "moefit: --expert-dtype = '" << dtype << "' must be fp32, bf16, fp8 or int4"
              << std::endl;
    return kExitBadInput;
  }
  if (const int64_t group = absl::GetFlag(FLAGS_int4_group_size); group != 0) {
    in.int4_group_size = group;
  }
  in.packed_weight_gib = absl::GetFlag(FLAGS_packed_weight_gb);
  const std::string isa = absl::GetFlag(FLAGS_cpu_isa);
  const auto* planned = std::find_if(
      std::begin(experts::kernels::kAllIsas), std::end(experts::kernels::kAllIsas),
      [&](experts::kernels::Isa i) {
        return i != experts::kernels::Isa::kPortable && experts::kernels::IsaName(i) == isa;
      });
  if (planned != std::end(experts::kernels::kAllIsas)) {
    in.cpu_isa = *planned;
  } else {
    std::cerr << "moefit: --cpu-isa = '" << isa << "' must be avx2, avx512, avx512_bf16 or amx_bf16"
              << std::endl;
    return kExitBadInput;
  }
  absl::StatusOr<bool> fits =
      RunPlan(absl::GetFlag(FLAGS_model), in, absl::GetFlag(FLAGS_json), std::cout);
  if (!fits.ok()) return Fail(fits.status());
  return *fits ? kExitOk : kExitDoesNotFit;
}

int Main(int argc, char** argv) {
  if (const char* t = std::getenv("MOEFIT_NUM_THREADS"); t != nullptr && std::atoi(t) > 0) {
    at::set_num_threads(std::atoi(t));
  }
  // Large host tensors reuse freed blocks (framework/host_allocator.h);
  // MOEFIT_HOST_ALLOCATOR=system keeps LibTorch's default.
  if (const char* a = std::getenv("MOEFIT_HOST_ALLOCATOR");
      a == nullptr || std::string(a) == "caching") {
    framework::UseCachingHostAllocator();
  } else if (std::string(a) != "system") {
    std::cerr << "moefit: MOEFIT_HOST_ALLOCATOR must be caching or system, not '" << a << "'"
              << std::endl;
    return kExitBadInput;
  }
  try {
    // A bad MOEFIT_CPU_ISA is bad input. On avx512_bf16 the form of its
    // kernels is measured here, on one thread, before any pool runs.
    experts::kernels::MultipliesBf16Pairs(experts::kernels::ActiveIsa());
  } catch (const c10::Error& e) {
    std::cerr << "moefit: " << e.what_without_backtrace() << std::endl;
    return kExitBadInput;
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
  const std::map<std::string, std::set<std::string>> flags = {
      {"train", {"set", "print_config"}},
      {"eval", {"set", "print_config", "eval_sequences", "save_logits", "input_ids"}},
      {"inspect", {}},
      {"export", {"max_shard_bytes", "save_dtype"}},
      {"merge", {"max_shard_bytes", "save_dtype"}},
      {"reshard", {"ep"}},
      {"expert-map", {"step", "out"}},
      {"routing-report",
       {"set", "print_config", "data", "sequences", "bootstrap", "confidence", "top", "json_out"}},
      {"plan",
       {"model", "nodes", "ram_gb", "gpus_per_node", "gpu_gb", "mode", "lora_rank", "expert_dtype",
        "int4_group_size", "packed_weight_gb", "cpu_isa", "seq_len", "micro_batch", "json"}},
  };
  auto it = flags.find(cmd);
  if (it == flags.end()) {
    std::cerr << "moefit: unknown command '" << cmd << "' (see moefit --help)" << std::endl;
    return kExitBadInput;
  }
  Args args;
  if (!ParseArgs(argc, argv, it->second, &args)) return kExitBadInput;
  if (args.help) {
    std::cout << Usage();
    return kExitOk;
  }

  if (cmd == "routing-report") {
    std::variant<RunConfig, int> loaded = LoadRun(args, cmd.c_str());
    if (const int* rc = std::get_if<int>(&loaded)) return *rc;
    const RunConfig& run = std::get<RunConfig>(loaded);
    parallel::ConfigureWatchdog({.timeout = absl::Seconds(run.timeout_s),
                                 .startup_timeout = absl::Seconds(run.startup_timeout_s)});
    RoutingReportOptions report;
    report.data = args.data;
    report.num_sequences = absl::GetFlag(FLAGS_sequences);
    report.num_resamples = absl::GetFlag(FLAGS_bootstrap);
    report.confidence = absl::GetFlag(FLAGS_confidence);
    report.top = absl::GetFlag(FLAGS_top);
    report.json_out = absl::GetFlag(FLAGS_json_out);
    return RunCollective(
        &argc, &argv,
        [&](auto world) {
          MOEFIT_RETURN_IF_ERROR(CheckStartupConsistency(run, MOEFIT_VERSION, *world));
          return RunRoutingReport(run, report, world, std::cout);
        },
        run.progress_thread_us);
  }
  if (cmd == "train" || cmd == "eval") {
    std::variant<RunConfig, int> loaded = LoadRun(args, cmd.c_str());
    if (const int* rc = std::get_if<int>(&loaded)) return *rc;
    const RunConfig& run = std::get<RunConfig>(loaded);
    parallel::ConfigureWatchdog({.timeout = absl::Seconds(run.timeout_s),
                                 .startup_timeout = absl::Seconds(run.startup_timeout_s)});
    if (cmd == "train") {
      return RunCollective(
          &argc, &argv,
          [&](auto world) {
            MOEFIT_RETURN_IF_ERROR(CheckStartupConsistency(run, MOEFIT_VERSION, *world));
            return RunTraining(run, world, std::cout);
          },
          run.progress_thread_us);
    }
    EvalOptions eval{absl::GetFlag(FLAGS_eval_sequences), absl::GetFlag(FLAGS_save_logits),
                     absl::GetFlag(FLAGS_input_ids)};
    return RunCollective(
        &argc, &argv,
        [&](auto world) {
          MOEFIT_RETURN_IF_ERROR(CheckStartupConsistency(run, MOEFIT_VERSION, *world));
          return RunEval(run, eval, world, std::cout);
        },
        run.progress_thread_us);
  }
  if (cmd == "inspect") {
    if (args.positional.size() != 1) {
      std::cerr << "moefit: usage: moefit inspect DIR|FILE" << std::endl;
      return kExitBadInput;
    }
    absl::Status s = RunInspect(args.positional[0], std::cout);
    return s.ok() ? kExitOk : Fail(s);
  }
  if (cmd == "plan") return PlanCommand(args);
  if (cmd == "expert-map") {
    if (args.positional.size() != 1 || absl::GetFlag(FLAGS_step) < 0) {
      std::cerr << "moefit: usage: moefit expert-map RUN_DIR [--step N] [--out FILE.png]"
                << std::endl;
      return kExitBadInput;
    }
    absl::Status s = RunExpertMapCommand(
        args.positional[0], {.step = absl::GetFlag(FLAGS_step), .out = absl::GetFlag(FLAGS_out)},
        std::cout);
    return s.ok() ? kExitOk : Fail(s);
  }
  if (cmd == "reshard") {
    if (args.positional.size() != 2 || absl::GetFlag(FLAGS_ep) < 1) {
      std::cerr << "moefit: usage: moefit reshard IN_DIR OUT_DIR --ep M (M >= 1)" << std::endl;
      return kExitBadInput;
    }
    return RunCollective(&argc, &argv, [&](auto world) {
      return RunReshard(args.positional[0], args.positional[1], absl::GetFlag(FLAGS_ep), world,
                        std::cout);
    });
  }
  // export and merge
  const size_t num_dirs = cmd == "merge" ? 3 : 2;
  if (args.positional.size() != num_dirs) {
    std::cerr << "moefit: usage: moefit "
              << (cmd == "merge" ? "merge BASE_DIR ADAPTER_DIR OUT_DIR" : "export SRC_DIR DST_DIR")
              << " [--max_shard_bytes N] [--save_dtype D]" << std::endl;
    return kExitBadInput;
  }
  ExportCommandOptions options;
  const std::optional<int64_t> shard_bytes = absl::GetFlag(FLAGS_max_shard_bytes);
  if (shard_bytes && *shard_bytes <= 0) {
    std::cerr << "moefit: --max_shard_bytes = " << *shard_bytes << " must be positive" << std::endl;
    return kExitBadInput;
  }
  options.max_shard_bytes = shard_bytes.value_or(0);  // 0: the commands take the default
  const std::string dtype = absl::GetFlag(FLAGS_save_dtype);
  if (dtype == "bfloat16") {
    options.dtype = at::kBFloat16;
  } else if (dtype == "float32") {
    options.dtype = at::kFloat;
  } else if (!dtype.empty()) {
    std::cerr << "moefit: --save_dtype = '" << dtype << "' must be float32 or bfloat16"
              << std::endl;
    return kExitBadInput;
  }
  if (cmd == "merge") {
    MergeCommandOptions merge{options.max_shard_bytes, options.dtype};
    return RunCollective(&argc, &argv, [&](auto world) {
      return RunMerge(args.positional[0], args.positional[1], args.positional[2], merge, world,
                      std::cout);
    });
  }
  return RunCollective(&argc, &argv, [&](auto world) {
    return RunExport(args.positional[0], args.positional[1], options, world, std::cout);
  });
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
