// Training-checkpoint save and load throughput against writing and reading
// the same bytes sequentially, in the same run, and the memory a save adds.
//
// Builds a generated qwen3_moe model (float32, all experts in this process;
// default about 0.8 GB of parameters, so about 2.4 GB of checkpoint with
// AdamW's m and v, which are filled with stand-in values rather than trained),
// then, under --dir:
//   save        SaveTrainingCheckpoint: files written and fsynced, CRC-32s of
//               every tensor and expert, manifest, directory renamed;
//   write()     the same tensors' bytes written one after another to a new
//               file with write(), then fsync, the previous such file deleted
//               (as keep_last 1 deletes the previous checkpoint): the
//               sequential-write ceiling;
//   load        LoadTrainingCheckpoint into the same trainer: headers checked,
//               each tensor's bytes read with pread straight into its memory,
//               every expert's checksum checked;
//   read()      that file read back with read() into the same tensors.
// Each is timed four times and the best counts (this machine's disk varies
// from run to run), save and write() taking turns to go first; the page cache is left as the
// previous case leaves it, alike for both sides. Peak RSS during the save above the RSS before it
// comes from VmHWM after a reset through /proc/self/clear_refs.
//
// Flags: --hidden=1024 --moe_intermediate=512 --experts=64 --layers=2 --dir=/tmp
//        --cold (load and read() from the disk, not the page cache)
#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "checkpoint/training_manifest.h"
#include "framework/adamw.h"
#include "framework/data.h"
#include "framework/model.h"
#include "framework/trainer.h"
#include "framework/training_checkpoint.h"
#include "launch/config.h"
#include "launch/corpus.h"

ABSL_FLAG(int64_t, hidden, 1024, "hidden_size");
ABSL_FLAG(int64_t, moe_intermediate, 512, "moe_intermediate_size");
ABSL_FLAG(int64_t, experts, 64, "num_experts");
ABSL_FLAG(int64_t, layers, 2, "num_hidden_layers");
ABSL_FLAG(bool, cold, false,
          "evict the files from the page cache (posix_fadvise DONTNEED) before load and read()");
ABSL_FLAG(std::string, dir, std::filesystem::temp_directory_path().string(),
          "where the files are written (a directory under it, removed at the end)");

namespace moefit::framework {
namespace {

namespace fs = std::filesystem;

// Each case is timed this many times (the best counts): disks and page caches vary.
constexpr int kReps = 4;

double Seconds(const std::chrono::steady_clock::time_point& start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// kB of a /proc/self/status field (VmRSS, VmHWM).
int64_t StatusKb(const std::string& field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::atoll(line.c_str() + field.size() + 1);
  }
  return -1;
}

void ResetPeakRss() { std::ofstream("/proc/self/clear_refs") << "5"; }

// Drops every file under `path` (or the file itself) from the page cache.
void Evict(const fs::path& path) {
  auto evict_file = [](const fs::path& file) {
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  };
  if (fs::is_directory(path)) {
    for (const auto& e : fs::recursive_directory_iterator(path)) {
      if (e.is_regular_file()) evict_file(e.path());
    }
  } else {
    evict_file(path);
  }
}

bool WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w <= 0) return false;
    p += w, n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, char* p, size_t n) {
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r <= 0) return false;
    p += r, n -= static_cast<size_t>(r);
  }
  return true;
}

int Main() {
  const fs::path dir = fs::path(absl::GetFlag(FLAGS_dir)) / "moefit_checkpoint_bench";
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto config = launch::LoadConfig(
      "", {"model.hidden_size=" + std::to_string(absl::GetFlag(FLAGS_hidden)),
           "model.moe_intermediate_size=" + std::to_string(absl::GetFlag(FLAGS_moe_intermediate)),
           "model.num_experts=" + std::to_string(absl::GetFlag(FLAGS_experts)),
           "model.num_hidden_layers=" + std::to_string(absl::GetFlag(FLAGS_layers)),
           "model.intermediate_size=512", "train.seq_len=16", "train.micro_batch_size=1",
           "logging.metrics_file="});
  if (!config.ok()) return std::fprintf(stderr, "%s\n", config.status().ToString().c_str()), 2;
  auto run = launch::ResolveConfig(*config);
  if (!run.ok()) return std::fprintf(stderr, "%s\n", run.status().ToString().c_str()), 2;
  auto data = TokenDataset::FromText(launch::ShippedCorpus(), run->seq_len, "corpus");
  auto model = MoeModel::Create(run->model, run->runtime, run->train.seed);
  if (!data.ok() || !model.ok()) return std::fprintf(stderr, "cannot build the model\n"), 1;
  Trainer trainer(**model, *data, run->train);
  // AdamW states as after a step (values do not matter to the I/O).
  FusedAdamW& opt = trainer.optimizer();
  std::vector<at::Tensor> tensors;
  for (size_t g = 0; g < opt.groups().size(); ++g) {
    for (size_t i = 0; i < opt.groups()[g].params.size(); ++i) {
      const at::Tensor& p = opt.groups()[g].params[i];
      opt.set_tensor_state(g, i, {p.detach() * 0.1, p.detach().square(), 1});
      FusedAdamW::TensorState s = opt.tensor_state(g, i);
      tensors.insert(tensors.end(), {p.detach(), s.m, s.v});
    }
  }
  uint64_t bytes = 0;
  for (const at::Tensor& t : tensors) bytes += t.nbytes();
  std::printf("model: %lld parameters; checkpoint tensors %.2f GB in %s\n",
              static_cast<long long>(bytes / 12), bytes / 1e9, dir.c_str());

  CheckpointingOptions options;
  options.save_dir = (dir / "ckpt").string();
  options.keep_last = 1;
  options.model_config = run->model_config;
  double save_s = 1e30, write_s = 1e30, load_s = 1e30, read_s = 1e30;
  int64_t save_peak_kb = 0;
  for (int rep = 0; rep < kReps; ++rep) {
    // Whichever writes first in a round is slower on this machine (it pays
    // for the page cache the previous round left), so the order alternates.
    const fs::path flat = dir / ("flat" + std::to_string(rep) + ".bin");
    auto save = [&]() -> bool {
      const int64_t rss_before = StatusKb("VmRSS");
      ResetPeakRss();
      auto start = std::chrono::steady_clock::now();
      absl::Status s = SaveTrainingCheckpoint(trainer, 1 + rep, options);
      save_s = std::min(save_s, Seconds(start));
      save_peak_kb = std::max(save_peak_kb, StatusKb("VmHWM") - rss_before);
      if (!s.ok()) return std::fprintf(stderr, "save: %s\n", s.ToString().c_str()), false;
      return true;
    };
    auto write = [&]() -> bool {
      // A new file each time, the previous one deleted after it, as the
      // checkpoints are (keep_last 1): the page cache churns alike.
      auto start = std::chrono::steady_clock::now();
      int fd = ::open(flat.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      for (const at::Tensor& t : tensors) {
        if (!WriteAll(fd, static_cast<const char*>(t.const_data_ptr()), t.nbytes())) return false;
      }
      ::fsync(fd);
      ::close(fd);
      if (rep > 0) fs::remove(dir / ("flat" + std::to_string(rep - 1) + ".bin"));
      write_s = std::min(write_s, Seconds(start));
      return true;
    };
    if (!(rep % 2 == 0 ? save() && write() : write() && save())) return 1;
    const fs::path saved = fs::path(options.save_dir) / checkpoint::StepDirName(1 + rep);
    if (absl::GetFlag(FLAGS_cold)) Evict(saved);
    auto start = std::chrono::steady_clock::now();
    auto step = LoadTrainingCheckpoint(trainer, saved);
    load_s = std::min(load_s, Seconds(start));
    if (!step.ok()) return std::fprintf(stderr, "load: %s\n", step.status().ToString().c_str()), 1;

    if (absl::GetFlag(FLAGS_cold)) Evict(flat);
    start = std::chrono::steady_clock::now();
    const int fd = ::open(flat.c_str(), O_RDONLY | O_CLOEXEC);
    for (const at::Tensor& t : tensors) {
      if (!ReadAll(fd, static_cast<char*>(t.data_ptr()), t.nbytes())) return 1;
    }
    ::close(fd);
    read_s = std::min(read_s, Seconds(start));
  }
  std::printf("save   %6.2f s  %5.2f GB/s   write() %6.2f s  %5.2f GB/s   save/write() %.2f\n",
              save_s, bytes / 1e9 / save_s, write_s, bytes / 1e9 / write_s, write_s / save_s);
  std::printf("load   %6.2f s  %5.2f GB/s   read()  %6.2f s  %5.2f GB/s   load/read()  %.2f\n",
              load_s, bytes / 1e9 / load_s, read_s, bytes / 1e9 / read_s, read_s / load_s);
  std::printf("peak RSS during save above the RSS before it: %.1f MB (checkpoint %.0f MB)\n",
              save_peak_kb / 1e3, bytes / 1e6);
  fs::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace moefit::framework

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return moefit::framework::Main();
}
