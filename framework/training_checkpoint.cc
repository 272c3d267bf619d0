// Training checkpoints; see training_checkpoint.h.
#include "framework/training_checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/Generator.h>
#include <fcntl.h>
#include <google/protobuf/util/message_differencer.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_io.h"
#include "checkpoint/training_manifest.h"
#include "framework/adamw.h"
#include "framework/output_dir.h"
#include "parallel/fault_injection.h"
#include "parallel/progress.h"
#include "proto/status_macros.h"
#include "proto/training_checkpoint.pb.h"

namespace moefit::framework {
namespace {

namespace fs = std::filesystem;
using checkpoint::Crc32;
using checkpoint::Crc32Combine;

constexpr char kDenseFile[] = "dense.safetensors";

std::string ExpertsFile(int ep_rank, int ep_size) {
  return absl::StrFormat("experts-%05d-of-%05d.safetensors", ep_rank, ep_size);
}
std::string RngFile(int rank) { return absl::StrFormat("rng-%05d.safetensors", rank); }

std::atomic<bool> g_stop_requested{false};

void OnStopSignal(int) { g_stop_requested.store(true); }

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::span<const std::byte> Bytes(const at::Tensor& t) {
  return {static_cast<const std::byte*>(t.const_data_ptr()), t.nbytes()};
}

// Where each trainable tensor sits in the optimizer.
std::map<const c10::TensorImpl*, std::pair<size_t, size_t>> OptimizerSlots(
    const FusedAdamW& optimizer) {
  std::map<const c10::TensorImpl*, std::pair<size_t, size_t>> slots;
  for (size_t g = 0; g < optimizer.groups().size(); ++g) {
    const std::vector<at::Tensor>& params = optimizer.groups()[g].params;
    for (size_t i = 0; i < params.size(); ++i) slots[params[i].unsafeGetTensorImpl()] = {g, i};
  }
  return slots;
}

// The CRC-32 of each of `num_rows` equal rows of `bytes`, rows in parallel.
std::vector<uint32_t> RowCrcs(std::span<const std::byte> bytes, int64_t num_rows) {
  const size_t row = bytes.size() / static_cast<size_t>(num_rows);
  std::vector<uint32_t> crcs(static_cast<size_t>(num_rows));
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
      crcs[static_cast<size_t>(x)] = Crc32(bytes.subspan(static_cast<size_t>(x) * row, row));
    }
  });
  return crcs;
}

// One safetensors file being assembled by this rank, with the manifest entry
// that describes it. The checksums are computed while the file is written (on
// another thread, over the same memory), so that they cost no time of their
// own when writing is the slower of the two.
class FileBuilder {
 public:
  FileBuilder(const fs::path& dir, std::string name, int rank) : dir_(dir), writer_(dir / name) {
    file_.set_path(std::move(name));
    file_.set_written_by_rank(rank);
  }

  // Queues `t` (any device) as `name`; `num_experts` > 0 marks a packed expert
  // tensor whose rows are global experts [expert_begin, expert_begin + num).
  absl::Status Add(const std::string& name, const at::Tensor& t, int64_t adam_step = 0,
                   int64_t expert_begin = 0, int64_t num_experts = 0) {
    at::Tensor cpu = t.detach().to(at::kCPU).contiguous();
    MOEFIT_ASSIGN_OR_RETURN(checkpoint::Dtype dtype, checkpoint::ToDtype(cpu.scalar_type()));
    proto::CheckpointTensor* e = file_.add_tensors();
    e->set_name(name);
    e->set_dtype(std::string(checkpoint::DtypeName(dtype)));
    for (int64_t d : cpu.sizes()) e->add_shape(d);
    e->set_adam_step(adam_step);
    if (num_experts > 0) {
      e->set_expert_begin(expert_begin);
      e->set_expert_end(expert_begin + num_experts);
    }
    pending_.push_back({cpu, num_experts});
    data_bytes_ += cpu.nbytes();
    return checkpoint::AddTensor(writer_, name, cpu);
  }

  // Writes the file (fsynced, renamed into place) and completes the entry
  // with its size and checksums.
  absl::StatusOr<proto::CheckpointFile> Finish() {
    std::future<uint32_t> data_crc = std::async(std::launch::async, [this] {
      uint32_t crc = 0;
      for (int i = 0; i < file_.tensors_size(); ++i) {
        const Pending& p = pending_[static_cast<size_t>(i)];
        proto::CheckpointTensor* e = file_.mutable_tensors(i);
        const std::span<const std::byte> bytes = Bytes(p.cpu);
        if (p.num_experts > 0) {
          const size_t row = bytes.size() / static_cast<size_t>(p.num_experts);
          uint32_t tensor_crc = 0;
          for (const uint32_t c : RowCrcs(bytes, p.num_experts)) {
            e->add_expert_crc32(c);
            tensor_crc = Crc32Combine(tensor_crc, c, row);
          }
          e->set_crc32(tensor_crc);
        } else {
          e->set_crc32(Crc32(bytes));
        }
        crc = Crc32Combine(crc, e->crc32(), bytes.size());
      }
      return crc;
    });
    const absl::Status written = writer_.Finish();
    const uint32_t crc = data_crc.get();
    pending_.clear();
    MOEFIT_RETURN_IF_ERROR(written);
    MOEFIT_RETURN_IF_ERROR(checkpoint::CompleteFileEntry(dir_, data_bytes_, crc, &file_));
    return file_;
  }

 private:
  struct Pending {
    at::Tensor cpu;  // what is written, held until its checksum is taken
    int64_t num_experts;
  };
  fs::path dir_;
  checkpoint::SafetensorsWriter writer_;
  proto::CheckpointFile file_;
  std::vector<Pending> pending_;
  uint64_t data_bytes_ = 0;
};

// Reads `bytes.size()` bytes at `offset` of `path` into `bytes`.
absl::Status PreadAll(const fs::path& path, uint64_t offset, std::span<std::byte> bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat("cannot open checkpoint file ", path.string(), ": ", std::strerror(errno)));
  }
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n =
        ::pread(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  if (done != bytes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint file ", path.string(), " is shorter than its header says"));
  }
  return absl::OkStatus();
}

// The generators this rank draws from: the CPU's, and the dense device's.
std::vector<std::pair<std::string, at::Generator>> Generators(const MoeModel& model) {
  std::vector<std::pair<std::string, at::Generator>> out = {
      {"cpu", at::detail::getDefaultCPUGenerator()}};
  const c10::Device dev = model.runtime().dense_device;
  if (!dev.is_cpu()) {
    out.emplace_back(c10::DeviceTypeName(dev.type(), /*lower_case=*/true),
                     at::globalContext().defaultGenerator(dev));
  }
  return out;
}

// Fault injection for the crash tests (tests/framework/checkpoint_kill.sh):
// MOEFIT_CHECKPOINT_KILL="POINT:RANK:STEP" makes world rank RANK kill itself
// with SIGKILL at POINT of the save after step STEP. Points: before_files
// (the temporary directory exists, nothing written), after_first_file (this
// rank's first file is written, its others are not), before_publish (rank 0:
// every file and the manifest written, the directory not yet renamed).
void MaybeKill(std::string_view point, int rank, int64_t step) {
  static const char* spec = std::getenv("MOEFIT_CHECKPOINT_KILL");
  if (spec == nullptr) return;
  if (std::string(spec) == absl::StrCat(std::string(point), ":", rank, ":", step)) {
    std::raise(SIGKILL);
  }
}

// This rank's files, written into `dir`.
absl::Status WriteRankFiles(Trainer& trainer, const fs::path& dir, int64_t steps_done,
                            std::vector<proto::CheckpointFile>* files) {
  MoeModel& model = trainer.model();
  const parallel::ProcessGroups& groups = trainer.groups();
  const int rank = groups.world->rank();
  const auto slots = OptimizerSlots(trainer.optimizer());
  auto state_of = [&](const at::Tensor& t) -> FusedAdamW::TensorState {
    auto it = slots.find(t.unsafeGetTensorImpl());
    if (it == slots.end()) return {};
    return trainer.optimizer().tensor_state(it->second.first, it->second.second);
  };
  auto add_with_state = [&](FileBuilder& fb, const Parameter& p, int64_t first,
                            int64_t num) -> absl::Status {
    const FusedAdamW::TensorState s = state_of(p.tensor);
    MOEFIT_RETURN_IF_ERROR(fb.Add("param/" + p.name, p.tensor, s.step, first, num));
    if (s.m.defined()) {
      MOEFIT_RETURN_IF_ERROR(fb.Add("exp_avg/" + p.name, s.m, s.step, first, num));
      MOEFIT_RETURN_IF_ERROR(fb.Add("exp_avg_sq/" + p.name, s.v, s.step, first, num));
    }
    return absl::OkStatus();
  };
  if (rank == 0) {
    FileBuilder dense(dir, kDenseFile, rank);
    for (const Parameter& p : model.trainable_parameters()) {
      if (!p.expert) MOEFIT_RETURN_IF_ERROR(add_with_state(dense, p, 0, 0));
    }
    for (const Parameter& b : model.buffers()) {
      MOEFIT_RETURN_IF_ERROR(dense.Add("buffer/" + b.name, b.tensor));
    }
    MOEFIT_ASSIGN_OR_RETURN(proto::CheckpointFile f, dense.Finish());
    files->push_back(std::move(f));
    MaybeKill("after_first_file", rank, steps_done);
    parallel::MaybeInjectFaultInSave(steps_done);
  }
  if (groups.ep_group_idx == 0) {
    // The first copy of the experts; replicas hold the same numbers.
    const int ep_rank = groups.expert_parallel->rank();
    const int64_t first = model.placement().first_expert(ep_rank);
    const int64_t num = model.placement().num_local(ep_rank);
    FileBuilder experts(dir, ExpertsFile(ep_rank, groups.expert_parallel->size()), rank);
    for (const Parameter& p : model.trainable_parameters()) {
      if (p.expert) MOEFIT_RETURN_IF_ERROR(add_with_state(experts, p, first, num));
    }
    MOEFIT_ASSIGN_OR_RETURN(proto::CheckpointFile f, experts.Finish());
    files->push_back(std::move(f));
    if (rank != 0) {
      MaybeKill("after_first_file", rank, steps_done);
      parallel::MaybeInjectFaultInSave(steps_done);
    }
  }
  FileBuilder rng(dir, RngFile(rank), rank);
  for (auto& [device, gen] : Generators(model)) {
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    MOEFIT_RETURN_IF_ERROR(rng.Add("rng/" + device, state));
  }
  MOEFIT_ASSIGN_OR_RETURN(proto::CheckpointFile f, rng.Finish());
  files->push_back(std::move(f));
  return absl::OkStatus();
}

// Rank 0: the manifest into `partial`, then the directory published as
// `final_dir`, then checkpoints beyond keep_last deleted.
absl::Status Publish(Trainer& trainer, int64_t steps_done, const CheckpointingOptions& options,
                     const std::vector<proto::CheckpointFile>& files, const fs::path& partial,
                     const fs::path& final_dir) {
  const MoeModel& model = trainer.model();
  const parallel::ProcessGroups& groups = trainer.groups();
  proto::TrainingCheckpointManifest m;
  m.set_format_version(checkpoint::kTrainingCheckpointFormatVersion);
  m.set_step(steps_done);
  m.set_mode(model.runtime().lora.enabled() ? "lora" : "full");
  proto::CheckpointLayout* layout = m.mutable_layout();
  layout->set_world_size(groups.world->size());
  layout->set_ep_size(groups.expert_parallel->size());
  for (int r = 0; r <= groups.expert_parallel->size(); ++r) {
    layout->add_expert_first(r < groups.expert_parallel->size() ? model.placement().first_expert(r)
                                                                : model.placement().num_experts());
  }
  for (const proto::CheckpointFile& f : files) *m.add_files() = f;
  m.set_config_text(options.config_text);
  *m.mutable_model() = options.model_config;
  m.set_data_seed(trainer.options().seed);
  m.set_global_batch(trainer.global_batch());
  m.set_data_num_sequences(trainer.num_sequences());
  m.set_last_lr(steps_done > 0 ? ScheduledLr(trainer.options(), steps_done - 1) : 0.0);
  m.set_total_steps(trainer.options().steps);
  m.set_end_of_manifest(true);
  MOEFIT_RETURN_IF_ERROR(checkpoint::WriteManifest(partial, m));
  MaybeKill("before_publish", 0, steps_done);
  MOEFIT_RETURN_IF_ERROR(PublishDirectory(partial, final_dir));
  // What interrupted saves and deletions left behind (hidden names only).
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(options.save_dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.starts_with(".step-") && (n.ends_with(".partial") || n.ends_with(".deleting"))) {
      std::error_code ignored;
      fs::remove_all(e.path(), ignored);
    }
  }
  if (options.keep_last > 0) {
    auto all = checkpoint::ListCheckpoints(options.save_dir);
    const int64_t excess = static_cast<int64_t>(all.size()) - options.keep_last;
    for (int64_t i = 0; i < excess; ++i) {
      if (all[i].second == final_dir) continue;
      std::error_code ec;
      // Renamed first so that a half-deleted directory never looks complete.
      const fs::path doomed =
          all[i].second.parent_path() / ("." + all[i].second.filename().string() + ".deleting");
      fs::rename(all[i].second, doomed, ec);
      if (!ec) fs::remove_all(doomed, ec);
    }
  }
  return absl::OkStatus();
}

// Runs checks one after another on a worker thread, in the order pushed, and
// keeps the first failure (later checks are skipped once one failed).
class CheckQueue {
 public:
  ~CheckQueue() { Finish().IgnoreError(); }

  void Push(std::function<absl::Status()> check) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!worker_.joinable()) worker_ = std::thread([this] { Work(); });
    pending_.push_back(std::move(check));
    wake_.notify_one();
  }

  // Waits for every pushed check; the first failure, if any.
  absl::Status Finish() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closing_ = true;
    }
    wake_.notify_one();
    if (worker_.joinable()) worker_.join();
    closing_ = false;
    return error_;
  }

 private:
  void Work() {
    for (;;) {
      std::function<absl::Status()> check;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [this] { return closing_ || !pending_.empty(); });
        if (pending_.empty()) return;
        check = std::move(pending_.front());
        pending_.pop_front();
      }
      if (error_.ok()) error_ = check();  // error_ is the worker's until joined
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<absl::Status()>> pending_;
  bool closing_ = false;
  absl::Status error_;
  std::thread worker_;
};

// The tensors of a manifest, by name; expert tensors have one entry per file.
struct TensorRef {
  const proto::CheckpointFile* file;
  const proto::CheckpointTensor* tensor;
};

// Reads checkpoint files for one rank: opened (and their headers checked)
// on first use; each tensor or expert row range checked against its CRC.
class CheckpointReader {
 public:
  CheckpointReader(fs::path dir, const proto::TrainingCheckpointManifest& manifest)
      : dir_(std::move(dir)) {
    for (const proto::CheckpointFile& f : manifest.files()) {
      for (const proto::CheckpointTensor& t : f.tensors()) refs_[t.name()].push_back({&f, &t});
    }
  }

  const std::vector<TensorRef>* Find(const std::string& name) const {
    auto it = refs_.find(name);
    return it == refs_.end() ? nullptr : &it->second;
  }

  // Reads rows [row_begin, row_end) of the tensor (all of it for non-expert
  // tensors: 0, 0) into `dst` (CPU, contiguous, exactly their size) with
  // pread, and checks their checksums: at once, or with `deferred` on a worker
  // thread while the next tensors are read (then `dst` must stay alive until
  // FinishChecks, which reports the first mismatch). Only those bytes of the
  // file are read.
  absl::Status ReadRows(const TensorRef& ref, int64_t row_begin, int64_t row_end,
                        const at::Tensor& dst, bool deferred = false) {
    MOEFIT_ASSIGN_OR_RETURN(const checkpoint::SafetensorsFile* file, Open(*ref.file));
    const fs::path path = dir_ / ref.file->path();
    const checkpoint::TensorInfo* info = file->Find(ref.tensor->name());
    if (info == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint file ", path.string(),
                                                     " lacks tensor ", ref.tensor->name(),
                                                     " listed in its manifest"));
    }
    if (std::string(checkpoint::DtypeName(info->dtype)) != ref.tensor->dtype() ||
        !std::equal(info->shape.begin(), info->shape.end(), ref.tensor->shape().begin(),
                    ref.tensor->shape().end())) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint file ", path.string(), ": tensor ",
                                                     ref.tensor->name(),
                                                     " differs from its manifest entry"));
    }
    const int64_t num_experts = ref.tensor->expert_end() - ref.tensor->expert_begin();
    const bool whole = num_experts <= 0;
    const size_t row = whole ? info->num_bytes() : info->num_bytes() / num_experts;
    const int64_t rows = whole ? 1 : row_end - row_begin;
    const uint64_t first_byte = whole ? 0 : static_cast<uint64_t>(row_begin) * row;
    std::span<std::byte> out(static_cast<std::byte*>(dst.data_ptr()), dst.nbytes());
    if (out.size() != row * static_cast<size_t>(rows)) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint file ", path.string(), ": tensor ",
                                                     ref.tensor->name(), " has the wrong size"));
    }
    // The data section starts right after the header the manifest checked.
    MOEFIT_RETURN_IF_ERROR(
        PreadAll(path, ref.file->header_bytes() + info->begin + first_byte, out));
    const proto::CheckpointTensor* tensor = ref.tensor;
    auto check = [=]() -> absl::Status {
      if (whole) {
        if (Crc32(out) != tensor->crc32()) return Mismatch(path, tensor->name());
        return absl::OkStatus();
      }
      if (tensor->expert_crc32_size() != num_experts) return Mismatch(path, tensor->name());
      const std::vector<uint32_t> crcs = RowCrcs(out, rows);
      for (int64_t x = 0; x < rows; ++x) {
        if (crcs[static_cast<size_t>(x)] != tensor->expert_crc32(static_cast<int>(row_begin + x))) {
          return Mismatch(path, absl::StrCat(tensor->name(), " (expert ",
                                             tensor->expert_begin() + row_begin + x, ")"));
        }
      }
      return absl::OkStatus();
    };
    if (!deferred) return check();
    checks_.Push(std::move(check));
    return absl::OkStatus();
  }

  // Waits for the deferred checks; the first mismatch, if any.
  absl::Status FinishChecks() { return checks_.Finish(); }

 private:
  static absl::Status Mismatch(const fs::path& path, const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("checksum mismatch in checkpoint file ", path.string(), ": tensor ", what));
  }

  absl::StatusOr<const checkpoint::SafetensorsFile*> Open(const proto::CheckpointFile& f) {
    auto it = open_.find(f.path());
    if (it != open_.end()) return &it->second;
    MOEFIT_RETURN_IF_ERROR(checkpoint::CheckFileHeader(dir_, f));
    absl::StatusOr<checkpoint::SafetensorsFile> file =
        checkpoint::SafetensorsFile::Open(dir_ / f.path());
    if (!file.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint file ", (dir_ / f.path()).string(),
                                                     ": ", file.status().message()));
    }
    return &open_.emplace(f.path(), std::move(*file)).first->second;
  }

  fs::path dir_;
  std::unordered_map<std::string, std::vector<TensorRef>> refs_;
  std::map<std::string, checkpoint::SafetensorsFile> open_;
  CheckQueue checks_;
};

absl::Status CheckDtype(const proto::CheckpointTensor& entry, const at::Tensor& target) {
  MOEFIT_ASSIGN_OR_RETURN(checkpoint::Dtype want, checkpoint::ToDtype(target.scalar_type()));
  if (entry.dtype() != checkpoint::DtypeName(want)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", entry.name(), " is ", entry.dtype(),
                                                   " in the checkpoint but ",
                                                   std::string(checkpoint::DtypeName(want)),
                                                   " in this run (experts.dtype or train.mode "
                                                   "differ from the saved run)"));
  }
  return absl::OkStatus();
}

// Reads rows of `ref` into `target` (same dtype, checked before): straight
// into its memory when it is contiguous on the CPU, else through a CPU copy.
absl::Status ReadRowsInto(CheckpointReader& reader, const TensorRef& ref, int64_t row_begin,
                          int64_t row_end, const at::Tensor& target) {
  if (target.device().is_cpu() && target.is_contiguous()) {
    // `target` is the model's or the optimizer's own memory: it outlives the
    // load, so its check may run while the next tensors are read.
    return reader.ReadRows(ref, row_begin, row_end, target, /*deferred=*/true);
  }
  at::Tensor staging = at::empty(target.sizes(), target.options().device(at::kCPU));
  MOEFIT_RETURN_IF_ERROR(reader.ReadRows(ref, row_begin, row_end, staging));
  target.copy_(staging);
  return absl::OkStatus();
}

// Fills `target` (this rank's tensor; for expert tensors its rows are global
// experts [first, first + rows)) from the checkpoint tensor `name`, and
// returns the AdamW step recorded with it.
absl::StatusOr<int64_t> ReadInto(CheckpointReader& reader, const std::string& name,
                                 const at::Tensor& target, bool expert, int64_t first) {
  const std::vector<TensorRef>* refs = reader.Find(name);
  if (refs == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("the checkpoint has no tensor ", name, " (the model differs)"));
  }
  std::vector<int64_t> shape(target.sizes().begin(), target.sizes().end());
  torch::NoGradGuard no_grad;
  if (!expert) {
    const TensorRef& ref = refs->front();
    MOEFIT_RETURN_IF_ERROR(CheckDtype(*ref.tensor, target));
    if (!std::equal(shape.begin(), shape.end(), ref.tensor->shape().begin(),
                    ref.tensor->shape().end())) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", name, " has another shape in the checkpoint"));
    }
    MOEFIT_RETURN_IF_ERROR(ReadRowsInto(reader, ref, 0, 0, target));
    return ref.tensor->adam_step();
  }
  const int64_t end = first + target.size(0);
  int64_t covered = 0;
  std::optional<int64_t> step;
  for (const TensorRef& ref : *refs) {
    const int64_t b = std::max(first, ref.tensor->expert_begin());
    const int64_t e = std::min(end, ref.tensor->expert_end());
    if (b >= e) continue;
    MOEFIT_RETURN_IF_ERROR(CheckDtype(*ref.tensor, target));
    if (ref.tensor->shape_size() != target.dim() ||
        !std::equal(shape.begin() + 1, shape.end(), ref.tensor->shape().begin() + 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", name, " has another shape in the checkpoint"));
    }
    MOEFIT_RETURN_IF_ERROR(ReadRowsInto(reader, ref, b - ref.tensor->expert_begin(),
                                        e - ref.tensor->expert_begin(),
                                        target.narrow(0, b - first, e - b)));
    covered += e - b;
    if (step && *step != ref.tensor->adam_step()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", name, ": its expert files disagree on the AdamW step"));
    }
    step = ref.tensor->adam_step();
  }
  if (covered != target.size(0)) {
    return absl::NotFoundError(absl::StrCat("the checkpoint lacks experts [", first, ", ", end,
                                            ") of ", name, " (an expert file is missing)"));
  }
  return *step;
}

// The manifest's model section against this run's, paths aside.
absl::Status CompareModel(const fs::path& dir, const proto::ModelConfig& saved,
                          const proto::ModelConfig& here) {
  google::protobuf::util::MessageDifferencer diff;
  const google::protobuf::Descriptor* d = proto::ModelConfig::descriptor();
  diff.IgnoreField(d->FindFieldByName("model_path"));
  diff.IgnoreField(d->FindFieldByName("config_json"));
  std::string report;
  diff.ReportDifferencesToString(&report);
  if (diff.Compare(saved, here)) return absl::OkStatus();
  // The differencer's lines read "modified: hidden_size: 32 -> 64",
  // "added: n_group: 4" (set here only), "deleted: ..." (in the checkpoint only).
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(report, '\n', absl::SkipEmpty())) {
    std::string suffix;
    if (absl::ConsumePrefix(&line, "modified: ")) {
    } else if (absl::ConsumePrefix(&line, "added: ")) {
      suffix = " (not set in the checkpoint)";
    } else if (absl::ConsumePrefix(&line, "deleted: ")) {
      suffix = " (set only in the checkpoint)";
    }
    lines.push_back(absl::StrCat("model.", line, suffix));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("the model config does not match the checkpoint ", dir.string(),
                   " (saved -> this run): ", absl::StrJoin(lines, "; ")));
}

}  // namespace

std::vector<proto::CheckpointFile> GatherCheckpointFiles(
    parallel::Communicator& world, const std::vector<proto::CheckpointFile>& mine) {
  proto::TrainingCheckpointManifest part;
  for (const proto::CheckpointFile& f : mine) *part.add_files() = f;
  const std::string bytes = part.SerializeAsString();
  at::Tensor size = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
  at::Tensor sizes = at::empty({world.size()}, at::kLong);
  world.AllGather(size, sizes)->WaitOrThrow();
  std::vector<int64_t> counts(sizes.data_ptr<int64_t>(), sizes.data_ptr<int64_t>() + world.size());
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  at::Tensor send = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(send.data_ptr(), bytes.data(), bytes.size());
  at::Tensor recv = at::empty({total}, at::kByte);
  world.AllGatherV(send, recv, counts)->WaitOrThrow();
  std::vector<proto::CheckpointFile> all;
  int64_t offset = 0;
  for (int64_t c : counts) {
    proto::TrainingCheckpointManifest other;
    other.ParseFromArray(static_cast<const char*>(recv.const_data_ptr()) + offset,
                         static_cast<int>(c));
    offset += c;
    for (const proto::CheckpointFile& f : other.files()) all.push_back(f);
  }
  return all;
}

absl::Status SaveTrainingCheckpoint(Trainer& trainer, int64_t steps_done,
                                    const CheckpointingOptions& options) {
  parallel::Communicator& world = *trainer.groups().world;
  const fs::path save_dir = options.save_dir;
  const std::string name = checkpoint::StepDirName(steps_done);
  const fs::path final_dir = save_dir / name;
  const fs::path partial = save_dir / ("." + name + ".partial");
  // Named in the watchdog's message should a peer go missing during the save.
  const parallel::ScopedPhase phase("saving a training checkpoint");
  absl::Status status;
  if (world.rank() == 0) {
    std::error_code ec;
    fs::create_directories(save_dir, ec);
    fs::remove_all(partial, ec);
    if (!ec) fs::create_directories(partial, ec);
    if (ec) {
      status =
          absl::InternalError(absl::StrCat("cannot create ", partial.string(), ": ", ec.message()));
    }
  }
  const auto failed_elsewhere = [&] {
    return absl::InternalError(
        absl::StrCat("the checkpoint ", final_dir.string(), " was not saved: another rank failed"));
  };
  if (AnyRankFailed(world, !status.ok())) return status.ok() ? failed_elsewhere() : status;
  MaybeKill("before_files", world.rank(), steps_done);
  std::vector<proto::CheckpointFile> mine;
  status = WriteRankFiles(trainer, partial, steps_done, &mine);
  if (AnyRankFailed(world, !status.ok())) return status.ok() ? failed_elsewhere() : status;
  std::vector<proto::CheckpointFile> all = GatherCheckpointFiles(world, mine);
  if (world.rank() == 0) status = Publish(trainer, steps_done, options, all, partial, final_dir);
  if (AnyRankFailed(world, !status.ok())) return status.ok() ? failed_elsewhere() : status;
  return absl::OkStatus();
}

absl::StatusOr<int64_t> LoadTrainingCheckpoint(Trainer& trainer, const fs::path& dir,
                                               const proto::ModelConfig* model_config) {
  parallel::Communicator& world = *trainer.groups().world;
  absl::StatusOr<int64_t> result = [&]() -> absl::StatusOr<int64_t> {
    MOEFIT_ASSIGN_OR_RETURN(proto::TrainingCheckpointManifest m, checkpoint::ReadManifest(dir));
    MoeModel& model = trainer.model();
    const std::string mode = model.runtime().lora.enabled() ? "lora" : "full";
    if (m.mode() != mode) {
      return absl::InvalidArgumentError(absl::StrCat("train.mode: the checkpoint ", dir.string(),
                                                     " was saved in mode ", m.mode(),
                                                     ", this run is ", mode));
    }
    if (model_config != nullptr)
      MOEFIT_RETURN_IF_ERROR(CompareModel(dir, m.model(), *model_config));
    if (m.data_seed() != trainer.options().seed) {
      return absl::InvalidArgumentError(absl::StrCat(
          "train.seed = ", trainer.options().seed, " but the checkpoint ", dir.string(),
          " was saved with ", m.data_seed(), " (the data order would differ)"));
    }
    if (m.data_num_sequences() != trainer.num_sequences()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data: ", trainer.num_sequences(), " sequences but the checkpoint ", dir.string(),
          " was saved on ", m.data_num_sequences(), " (another data set or train.seq_len)"));
    }
    if (m.global_batch() != trainer.global_batch()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "train.micro_batch_size x ranks x train.grad_accum_steps = ", trainer.global_batch(),
          " sequences per step, but the checkpoint ", dir.string(), " was saved with ",
          m.global_batch(), "; set train.micro_batch_size so that the global batch is equal"));
    }
    CheckpointReader reader(dir, m);
    const parallel::ProcessGroups& groups = trainer.groups();
    const int64_t first = model.placement().first_expert(groups.expert_parallel->rank());
    FusedAdamW& optimizer = trainer.optimizer();
    const auto slots = OptimizerSlots(optimizer);
    for (const Parameter& p : model.trainable_parameters()) {
      MOEFIT_ASSIGN_OR_RETURN(int64_t step,
                              ReadInto(reader, "param/" + p.name, p.tensor, p.expert, first));
      auto slot = slots.find(p.tensor.unsafeGetTensorImpl());
      if (slot == slots.end()) continue;
      FusedAdamW::TensorState s;
      if (reader.Find("exp_avg/" + p.name) != nullptr) {
        // Into the optimizer's own buffers when it has them already.
        s = optimizer.tensor_state(slot->second.first, slot->second.second);
        if (!s.m.defined()) {
          s.m = at::empty_like(p.tensor, at::MemoryFormat::Contiguous);
          s.v = at::empty_like(p.tensor, at::MemoryFormat::Contiguous);
        }
        MOEFIT_RETURN_IF_ERROR(
            ReadInto(reader, "exp_avg/" + p.name, s.m, p.expert, first).status());
        MOEFIT_RETURN_IF_ERROR(
            ReadInto(reader, "exp_avg_sq/" + p.name, s.v, p.expert, first).status());
        s.step = step;
      }
      optimizer.set_tensor_state(slot->second.first, slot->second.second, std::move(s));
    }
    for (const Parameter& b : model.buffers()) {
      MOEFIT_RETURN_IF_ERROR(ReadInto(reader, "buffer/" + b.name, b.tensor, false, 0).status());
    }
    const int rank = world.rank();
    // This rank's generator states: restored when the checkpoint has them for
    // this very layout (a checkpoint resharded offline has none).
    std::vector<std::pair<at::Generator, const TensorRef*>> states;
    for (auto& [device, gen] : Generators(model)) {
      const std::vector<TensorRef>* refs = reader.Find("rng/" + device);
      for (size_t i = 0; refs != nullptr && i < refs->size(); ++i) {
        if ((*refs)[i].file->written_by_rank() == rank) states.emplace_back(gen, &(*refs)[i]);
      }
    }
    if (m.layout().world_size() == world.size() && !states.empty()) {
      for (auto& [gen, ref] : states) {
        std::vector<int64_t> shape(ref->tensor->shape().begin(), ref->tensor->shape().end());
        at::Tensor state = at::empty(shape, at::kByte);
        if (ref->tensor->dtype() != "U8") {
          return absl::InvalidArgumentError(
              absl::StrCat("generator state ", ref->tensor->name(), " is not U8"));
        }
        MOEFIT_RETURN_IF_ERROR(reader.ReadRows(*ref, 0, 0, state));
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(state);
      }
    } else {
      // Streams cannot follow the ranks to another layout: a fresh one per
      // rank and step, the same on every resume at this layout.
      at::manual_seed(trainer.options().seed + static_cast<uint64_t>(rank) +
                      0x9E3779B97F4A7C15ull * static_cast<uint64_t>(m.step() + 1));
    }
    MOEFIT_RETURN_IF_ERROR(reader.FinishChecks());
    model.SyncExpertCopies();
    trainer.set_first_step(m.step());
    return m.step();
  }();
  const bool failed = !result.ok();
  if (AnyRankFailed(world, failed)) {
    if (failed) return result.status();
    return absl::InternalError(
        absl::StrCat("loading the checkpoint ", dir.string(), " failed on another rank"));
  }
  return result;
}

absl::StatusOr<int64_t> LoadCheckpointWeights(MoeModel& model, int ep_rank, const fs::path& dir) {
  MOEFIT_ASSIGN_OR_RETURN(proto::TrainingCheckpointManifest m, checkpoint::ReadManifest(dir));
  const std::string mode = model.runtime().lora.enabled() ? "lora" : "full";
  if (m.mode() != mode) {
    return absl::InvalidArgumentError(absl::StrCat("train.mode: the checkpoint ", dir.string(),
                                                   " was saved in mode ", m.mode(),
                                                   ", this model is ", mode));
  }
  CheckpointReader reader(dir, m);
  const int64_t first = model.placement().first_expert(ep_rank);
  for (const Parameter& p : model.trainable_parameters()) {
    MOEFIT_RETURN_IF_ERROR(ReadInto(reader, "param/" + p.name, p.tensor, p.expert, first).status());
  }
  for (const Parameter& b : model.buffers()) {
    MOEFIT_RETURN_IF_ERROR(ReadInto(reader, "buffer/" + b.name, b.tensor, false, 0).status());
  }
  MOEFIT_RETURN_IF_ERROR(reader.FinishChecks());
  model.SyncExpertCopies();
  return m.step();
}

absl::StatusOr<fs::path> ResolveResumeDir(const std::string& resume_from,
                                          const std::string& save_dir) {
  if (resume_from != "latest") return fs::path(resume_from);
  if (save_dir.empty()) {
    return absl::InvalidArgumentError(
        "checkpoint.resume_from = 'latest' looks in checkpoint.save_dir, which is not set");
  }
  return checkpoint::LatestCheckpoint(save_dir);
}

void InstallStopSignalHandlers() {
  struct sigaction action {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}

void RequestStop() { g_stop_requested.store(true); }
bool StopRequested() { return g_stop_requested.load(); }
void ClearStopRequest() { g_stop_requested.store(false); }

Checkpointer::Checkpointer(Trainer& trainer, CheckpointingOptions options, std::ostream& log)
    : trainer_(trainer), options_(std::move(options)), log_(log), last_save_time_(NowSeconds()) {}

StepEndHook Checkpointer::Hook() {
  return [this](int64_t steps_done) { return AtStepEnd(steps_done); };
}

absl::StatusOr<bool> Checkpointer::AtStepEnd(int64_t steps_done) {
  parallel::Communicator& world = *trainer_.groups().world;
  const bool time_due = world.rank() == 0 && options_.save_every_minutes > 0 &&
                        NowSeconds() - last_save_time_ >= options_.save_every_minutes * 60;
  at::Tensor flags = at::tensor(
      {static_cast<int64_t>(StopRequested()), static_cast<int64_t>(time_due)}, at::kLong);
  {
    // A rank done with its step early waits here: the step's deadline applies.
    const parallel::ScopedStepEnd step_end(steps_done);
    world.AllReduce(flags, parallel::ReduceOp::kMax)->WaitOrThrow();
  }
  const bool stop = flags[0].item<int64_t>() != 0;
  const bool due = stop || flags[1].item<int64_t>() != 0 ||
                   (options_.save_every_steps > 0 && steps_done % options_.save_every_steps == 0) ||
                   steps_done == trainer_.options().steps;
  if (due) {
    const auto start = std::chrono::steady_clock::now();
    MOEFIT_RETURN_IF_ERROR(SaveTrainingCheckpoint(trainer_, steps_done, options_));
    last_save_time_ = NowSeconds();
    last_saved_ = steps_done;
    log_ << absl::StrFormat(
                "moefit: saved the training checkpoint %s in %.1f s",
                (fs::path(options_.save_dir) / checkpoint::StepDirName(steps_done)).string(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count())
         << std::endl;
  }
  if (stop) {
    stopped_ = true;
    log_ << "moefit: stopped by a signal after step " << steps_done << std::endl;
  }
  return stop;
}

}  // namespace moefit::framework
