// Checkpoint loading throughput and peak memory, against the machine's ceiling
// and the naive load, measured in the same run.
//
// Writes a synthetic multi-shard qwen3_moe-style checkpoint (per-expert BF16
// keys, Qwen3-30B-A3B-like widths, about --size_mb in total) under a temporary
// directory, then measures, each in its own forked child so peak RSS (ru_maxrss
// from wait4) does not mix between cases:
//   read()        every shard read sequentially into one buffer: the disk /
//                 page-cache ceiling;
//   naive         every tensor read into its own tensor, then torch.stack / cat
//                 per packed target (what a key-by-key loader does);
//   LoadCheckpoint  the converter: all experts, and one rank's half of them.
// Every child is forked from a parent that never touched torch, so no thread
// pool crosses a fork. The directory is deleted at the end.
//
// Flags: --size_mb=2048 --experts=64 --hidden=2048 --inter=768 --shard_mb=1024
//        --threads=0 (oneTBB default) --dir=<base of the temp dir> --cold
// (--cold evicts the files from the page cache before each case with
// posix_fadvise(DONTNEED), so the cases read from disk.)
#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/natural_order.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/safetensors_index.h"
#include "checkpoint/tensor_io.h"
#include "checkpoint/weight_loader.h"

namespace moefit::checkpoint {
namespace {

struct BenchOptions {
  int64_t size_mb = 2048;
  int64_t num_experts = 64;
  int64_t hidden = 2048;
  int64_t inter = 768;
  int64_t shard_mb = 1024;
  int num_threads = 0;
  std::filesystem::path base_dir = std::filesystem::temp_directory_path();
  bool cold = false;
};

constexpr int64_t kVocab = 16384;

// One case's result, sent from the child through a pipe.
struct CaseResult {
  double seconds = 0;
  uint64_t num_bytes = 0;  // tensor bytes the case had to deliver
  int ok = 0;
};

int64_t ExpertBytes(const BenchOptions& o) { return 3 * o.hidden * o.inter * 2; }
int64_t LayerBytes(const BenchOptions& o) {
  return o.num_experts * ExpertBytes(o) + 4 * o.hidden * o.hidden * 2 +
         o.num_experts * o.hidden * 2;
}
int64_t NumLayers(const BenchOptions& o) {
  const int64_t dense = 2 * kVocab * o.hidden * 2;
  const int64_t layers = (o.size_mb * (int64_t{1} << 20) - dense) / LayerBytes(o);
  return std::max<int64_t>(layers, 1);
}

// Tensor names and shapes of the synthetic checkpoint, in natural order.
std::vector<std::pair<std::string, std::vector<int64_t>>> Layout(const BenchOptions& o) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  out.push_back({"model.embed_tokens.weight", {kVocab, o.hidden}});
  out.push_back({"lm_head.weight", {kVocab, o.hidden}});
  out.push_back({"model.norm.weight", {o.hidden}});
  for (int64_t l = 0; l < NumLayers(o); ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    out.push_back({p + "input_layernorm.weight", {o.hidden}});
    out.push_back({p + "post_attention_layernorm.weight", {o.hidden}});
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
      out.push_back({p + "self_attn." + proj + ".weight", {o.hidden, o.hidden}});
    }
    out.push_back({p + "mlp.gate.weight", {o.num_experts, o.hidden}});
    for (int64_t e = 0; e < o.num_experts; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      out.push_back({x + "gate_proj.weight", {o.inter, o.hidden}});
      out.push_back({x + "up_proj.weight", {o.inter, o.hidden}});
      out.push_back({x + "down_proj.weight", {o.hidden, o.inter}});
    }
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return NaturalLess(a.first, b.first); });
  return out;
}

// Writes the checkpoint (random BF16) as shards of about shard_mb plus an index.
bool WriteCheckpoint(const BenchOptions& o, const std::filesystem::path& dir) {
  const auto layout = Layout(o);
  std::vector<TensorSize> sizes;
  for (const auto& [name, shape] : layout) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    sizes.push_back({name, static_cast<uint64_t>(numel) * 2});
  }
  absl::StatusOr<ShardPlan> plan =
      PlanShards(sizes, {.max_shard_bytes = static_cast<uint64_t>(o.shard_mb) << 20});
  if (!plan.ok()) return false;
  std::map<std::string, std::vector<int64_t>> shapes(layout.begin(), layout.end());
  for (size_t shard_idx = 0; shard_idx < plan->shard_files.size(); ++shard_idx) {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const std::string& name : plan->shard_tensors[shard_idx]) {
      tensors.emplace_back(name,
                           at::empty(shapes[name], at::kFloat).uniform_(-1, 1).to(at::kBFloat16));
    }
    absl::Status saved = SaveTensors(dir / plan->shard_files[shard_idx], tensors, {.sync = false});
    if (!saved.ok()) {
      std::fprintf(stderr, "%s\n", std::string(saved.message()).c_str());
      return false;
    }
  }
  if (plan->needs_index()) {
    return WriteShardedIndex(dir / std::string(kIndexFileName), plan->index).ok();
  }
  return true;
}

std::vector<std::filesystem::path> ShardPaths(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> paths;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() == ".safetensors") paths.push_back(entry.path());
  }
  std::sort(paths.begin(), paths.end());
  return paths;
}

void Evict(const std::filesystem::path& dir) {
  for (const auto& path : ShardPaths(dir)) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Case: sequential read() of every shard into one 16 MiB buffer.
CaseResult SequentialRead(const std::filesystem::path& dir) {
  CaseResult r;
  std::vector<char> buffer(16 << 20);
  const double start = Now();
  for (const auto& path : ShardPaths(dir)) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return r;
    ssize_t n;
    while ((n = ::read(fd, buffer.data(), buffer.size())) > 0) r.num_bytes += n;
    ::close(fd);
  }
  r.seconds = Now() - start;
  r.ok = 1;
  return r;
}

// Case: every tensor into its own tensor, then stack per packed target.
CaseResult NaiveLoad(const std::filesystem::path& dir, const BenchOptions& o) {
  CaseResult r;
  const double start = Now();
  std::map<std::string, at::Tensor> all;
  for (const auto& path : ShardPaths(dir)) {
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
    if (!file.ok()) return r;
    for (const TensorInfo& info : file->tensors()) {
      absl::StatusOr<at::Tensor> t = ReadTensor(*file, info, {.copy = true});
      if (!t.ok()) return r;
      r.num_bytes += info.num_bytes();
      all.emplace(info.name, *t);
    }
  }
  std::map<std::string, at::Tensor> packed;
  for (int64_t l = 0; l < NumLayers(o); ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts.";
    std::vector<at::Tensor> gates, ups, downs;
    for (int64_t e = 0; e < o.num_experts; ++e) {
      const std::string x = p + std::to_string(e) + ".";
      gates.push_back(all.at(x + "gate_proj.weight"));
      ups.push_back(all.at(x + "up_proj.weight"));
      downs.push_back(all.at(x + "down_proj.weight"));
    }
    packed[p + "gate_up_proj"] = at::cat({at::stack(gates), at::stack(ups)}, 1);
    packed[p + "down_proj"] = at::stack(downs);
  }
  r.seconds = Now() - start;
  r.ok = 1;
  return r;
}

CaseResult Converter(const std::filesystem::path& dir, const BenchOptions& o,
                     std::optional<int64_t> num_experts) {
  CaseResult r;
  LoadReport report;
  LoadOptions options{.num_experts = num_experts, .num_threads = o.num_threads};
  const double start = Now();
  absl::StatusOr<std::map<std::string, at::Tensor>> loaded =
      LoadCheckpoint(dir, "qwen3_moe", options, &report);
  r.seconds = Now() - start;
  if (!loaded.ok()) {
    std::fprintf(stderr, "%s\n", std::string(loaded.status().message()).c_str());
    return r;
  }
  r.num_bytes = report.num_bytes_read;
  r.ok = 1;
  return r;
}

// Runs `body` in a forked child; returns its result and peak RSS in MiB.
std::pair<CaseResult, double> InChild(const std::function<CaseResult()>& body) {
  int fds[2];
  if (::pipe(fds) != 0) return {};
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    const CaseResult r = body();
    const ssize_t written = ::write(fds[1], &r, sizeof(r));
    ::_exit(written == sizeof(r) ? 0 : 1);
  }
  ::close(fds[1]);
  CaseResult r;
  const ssize_t got = ::read(fds[0], &r, sizeof(r));
  ::close(fds[0]);
  int status = 0;
  struct rusage usage {};
  ::wait4(pid, &status, 0, &usage);
  if (got != sizeof(r) || !WIFEXITED(status) || WEXITSTATUS(status) != 0) r.ok = 0;
  return {r, usage.ru_maxrss / 1024.0};
}

bool ParseFlag(const char* arg, const char* name, std::string& value) {
  const size_t n = std::strlen(name);
  if (std::strncmp(arg, name, n) != 0 || arg[n] != '=') return false;
  value = arg + n + 1;
  return true;
}

int Main(int argc, char** argv) {
  BenchOptions o;
  for (int i = 1; i < argc; ++i) {
    std::string v;
    if (ParseFlag(argv[i], "--size_mb", v)) {
      o.size_mb = std::stoll(v);
    } else if (ParseFlag(argv[i], "--experts", v)) {
      o.num_experts = std::stoll(v);
    } else if (ParseFlag(argv[i], "--hidden", v)) {
      o.hidden = std::stoll(v);
    } else if (ParseFlag(argv[i], "--inter", v)) {
      o.inter = std::stoll(v);
    } else if (ParseFlag(argv[i], "--shard_mb", v)) {
      o.shard_mb = std::stoll(v);
    } else if (ParseFlag(argv[i], "--threads", v)) {
      o.num_threads = std::stoi(v);
    } else if (ParseFlag(argv[i], "--dir", v)) {
      o.base_dir = v;
    } else if (std::strcmp(argv[i], "--cold") == 0) {
      o.cold = true;
    } else {
      std::fprintf(stderr, "unknown flag %s (see the top of load_bench.cc)\n", argv[i]);
      return 2;
    }
  }
  char pattern[] = "moefit_load_bench_XXXXXX";
  const std::filesystem::path templ = o.base_dir / pattern;
  std::string dir_buf = templ.string();
  if (::mkdtemp(dir_buf.data()) == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::filesystem::path dir = dir_buf;
  std::printf(
      "checkpoint: %s, %lld layers x %lld experts (H=%lld, I=%lld), BF16, shards <= %lld MiB\n",
      dir.c_str(), static_cast<long long>(NumLayers(o)), static_cast<long long>(o.num_experts),
      static_cast<long long>(o.hidden), static_cast<long long>(o.inter),
      static_cast<long long>(o.shard_mb));
  const auto [written, write_rss] = InChild([&] {
    CaseResult r;
    const double start = Now();
    r.ok = WriteCheckpoint(o, dir) ? 1 : 0;
    r.seconds = Now() - start;
    return r;
  });
  if (!written.ok) {
    std::fprintf(stderr, "writing the checkpoint failed\n");
    std::filesystem::remove_all(dir);
    return 1;
  }
  uint64_t file_bytes = 0;
  for (const auto& path : ShardPaths(dir)) file_bytes += std::filesystem::file_size(path);
  std::printf("wrote %.1f MiB in %zu files (%.1f s); page cache: %s\n\n", file_bytes / 1048576.0,
              ShardPaths(dir).size(), written.seconds,
              o.cold ? "evicted before each case" : "warm");

  struct Case {
    const char* name;
    std::function<CaseResult()> body;
  };
  const std::vector<Case> cases = {
      {"read() sequential (ceiling)", [&] { return SequentialRead(dir); }},
      {"naive: read all, then stack", [&] { return NaiveLoad(dir, o); }},
      {"LoadCheckpoint, all experts", [&] { return Converter(dir, o, std::nullopt); }},
      {"LoadCheckpoint, half the experts", [&] { return Converter(dir, o, o.num_experts / 2); }},
  };
  std::printf("%-34s %10s %10s %9s %14s\n", "case", "MiB", "seconds", "GB/s", "peak RSS MiB");
  for (const Case& c : cases) {
    if (o.cold) Evict(dir);
    const auto [r, rss] = InChild(c.body);
    if (!r.ok) {
      std::printf("%-34s failed\n", c.name);
      continue;
    }
    std::printf("%-34s %10.1f %10.3f %9.2f %14.1f\n", c.name, r.num_bytes / 1048576.0, r.seconds,
                r.num_bytes / r.seconds / 1e9, rss);
  }
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace moefit::checkpoint

int main(int argc, char** argv) { return moefit::checkpoint::Main(argc, argv); }
