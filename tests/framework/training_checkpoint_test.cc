// Training checkpoints in one process: a run stopped at step 4 and resumed
// from its checkpoint gives bitwise the losses and final weights of the
// uninterrupted run (float32; bfloat16 experts with float32 masters; LoRA with
// dropout, whose masks come from the restored generator; deepseek_v3 with
// moving correction biases); keep_last (and the removal of what killed saves
// left); saving by time and after the last step; "latest"; and the load
// errors, each naming the file or field.
#include "framework/training_checkpoint.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "checkpoint/training_manifest.h"
#include "framework/data.h"
#include "framework/hf_io.h"
#include "framework/model.h"
#include "framework/trainer.h"
#include "launch/config.h"
#include "launch/corpus.h"
#include "launch/export_command.h"
#include "parallel/local_communicator.h"
#include "tests/framework/test_configs.h"

namespace moefit::framework {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kSteps = 8;
constexpr int64_t kStopAt = 4;

std::vector<std::string> Sets(const std::string& variant) {
  std::vector<std::string> s = {"train.steps=" + std::to_string(kSteps),
                                "train.seq_len=32",
                                "train.micro_batch_size=4",
                                "model.hidden_size=64",
                                "model.head_dim=16",
                                "model.moe_intermediate_size=32",
                                "model.num_hidden_layers=2",
                                "logging.metrics_file=",
                                "schedule.warmup_steps=2"};
  if (variant == "bf16") s.push_back("experts.dtype=bfloat16");
  if (variant == "lora") {
    s.insert(s.end(), {"train.mode=lora", "lora.rank=4", "lora.alpha=8", "lora.dropout=0.1",
                       "lora.target_modules=[all-linear,experts]"});
  }
  if (variant == "deepseek_v3") {
    s.insert(s.end(), {"model.model_type=deepseek_v3", "model.router_aux_loss_coef=0",
                       "model.q_lora_rank=24", "model.kv_lora_rank=16", "model.qk_nope_head_dim=16",
                       "model.qk_rope_head_dim=8", "model.v_head_dim=16", "model.n_group=4",
                       "model.topk_group=2", "model.first_k_dense_replace=1",
                       "model.aux_loss_alpha=0.01", "router.bias_update_rate=0.01"});
  }
  return s;
}

launch::RunConfig MakeRun(const std::string& variant, std::vector<std::string> extra = {}) {
  std::vector<std::string> s = Sets(variant);
  s.insert(s.end(), extra.begin(), extra.end());
  launch::RunConfig run = DemoRunConfig(s);
  run.runtime.expert_master_weights = true;  // as moefit train
  return run;
}

CheckpointingOptions Options(const launch::RunConfig& run, const fs::path& dir) {
  CheckpointingOptions o;
  o.save_dir = dir.string();
  o.config_text = run.config_text;
  o.model_config = run.model_config;
  return o;
}

struct Result {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> tensors;  // trainable tensors and buffers at the end
};

// Trains `run`; with `save_dir`, stops after kStopAt steps with a checkpoint
// there; with `resume`, starts from that checkpoint (the model only allocated
// in full mode, so that nothing but the checkpoint can fill it).
Result Train(const launch::RunConfig& run, const fs::path& save_dir = {},
             const fs::path& resume = {}) {
  auto data = TokenDataset::FromText(launch::ShippedCorpus(), run.seq_len, "corpus");
  EXPECT_TRUE(data.ok()) << data.status();
  const WeightInit init = !resume.empty() && !run.runtime.lora.enabled()
                              ? WeightInit::kUninitialized
                              : WeightInit::kRandom;
  auto model = MoeModel::Create(run.model, run.runtime, run.train.seed, init);
  EXPECT_TRUE(model.ok()) << model.status();
  Trainer trainer(**model, *data, run.train);
  if (!resume.empty()) {
    absl::StatusOr<int64_t> step = LoadTrainingCheckpoint(trainer, resume, &run.model_config);
    EXPECT_TRUE(step.ok()) << step.status();
    EXPECT_EQ(*step, kStopAt);
  }
  Checkpointer checkpointer(trainer, Options(run, save_dir), std::cerr);
  Result out;
  std::ostringstream log;
  auto after = [&](const StepStats& st) {
    out.losses.push_back(st.loss);
    if (!save_dir.empty() && st.step == kStopAt) RequestStop();
  };
  auto stats = trainer.Run(log, after, save_dir.empty() ? StepEndHook() : checkpointer.Hook());
  ClearStopRequest();
  EXPECT_TRUE(stats.ok()) << stats.status();
  for (const Parameter& p : (*model)->trainable_parameters()) {
    out.tensors[p.name] = p.tensor.detach().clone();
  }
  for (const Parameter& b : (*model)->buffers()) out.tensors[b.name] = b.tensor.detach().clone();
  return out;
}

fs::path FreshDir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("moefit_ckpt_" + name);
  fs::remove_all(dir);
  return dir;
}

// The names of the directories in `dir`, sorted.
std::vector<std::string> Listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

class Resume : public ::testing::TestWithParam<std::string> {};

TEST_P(Resume, StoppedAndResumedEqualsUninterruptedBitwise) {
  const launch::RunConfig run = MakeRun(GetParam());
  const Result whole = Train(run);
  ASSERT_EQ(whole.losses.size(), kSteps);

  const fs::path dir = FreshDir("resume_" + GetParam());
  const Result first = Train(run, dir);
  ASSERT_EQ(first.losses.size(), kStopAt);  // stopped by the request, with a checkpoint
  const fs::path ckpt = dir / checkpoint::StepDirName(kStopAt);
  ASSERT_TRUE(fs::exists(ckpt / checkpoint::kManifestName));

  const Result second = Train(run, {}, ckpt);
  ASSERT_EQ(second.losses.size(), kSteps - kStopAt);
  for (int64_t s = 0; s < kSteps; ++s) {
    const double resumed = s < kStopAt ? first.losses[s] : second.losses[s - kStopAt];
    EXPECT_EQ(resumed, whole.losses[s]) << "step " << s + 1;
  }
  ASSERT_EQ(second.tensors.size(), whole.tensors.size());
  for (const auto& [name, t] : whole.tensors) {
    EXPECT_TRUE(at::equal(second.tensors.at(name), t)) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, Resume,
                         ::testing::Values("fp32", "bf16", "lora", "deepseek_v3"));

TEST(TrainingCheckpoint, ManifestListsEveryFileAndTensor) {
  const launch::RunConfig run = MakeRun("fp32");
  const fs::path dir = FreshDir("manifest");
  Train(run, dir);
  auto m = checkpoint::ReadManifest(dir / checkpoint::StepDirName(kStopAt));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->step(), kStopAt);
  EXPECT_EQ(m->mode(), "full");
  EXPECT_EQ(m->layout().world_size(), 1);
  EXPECT_EQ(m->layout().ep_size(), 1);
  std::map<std::string, const proto::CheckpointFile*> files;
  for (const auto& f : m->files()) files[f.path()] = &f;
  ASSERT_EQ(files.size(), 3u);
  ASSERT_TRUE(files.count("dense.safetensors"));
  ASSERT_TRUE(files.count("experts-00000-of-00001.safetensors"));
  ASSERT_TRUE(files.count("rng-00000.safetensors"));
  for (const auto& [name, f] : files) {
    EXPECT_TRUE(checkpoint::CheckWholeFile(dir / checkpoint::StepDirName(kStopAt), *f).ok())
        << name;
  }
  // Every expert tensor holds all 8 experts, with one checksum each; each
  // trained tensor has its moments, at AdamW step 4.
  int num_expert_tensors = 0;
  for (const auto& t : files["experts-00000-of-00001.safetensors"]->tensors()) {
    EXPECT_EQ(t.expert_begin(), 0);
    EXPECT_EQ(t.expert_end(), 8);
    EXPECT_EQ(t.expert_crc32_size(), 8);
    EXPECT_EQ(t.adam_step(), kStopAt);
    ++num_expert_tensors;
  }
  EXPECT_EQ(num_expert_tensors, 2 * 2 * 3);  // gate_up and down of 2 layers, param + 2 moments
  EXPECT_EQ(m->model().hidden_size(), 64);
}

TEST(TrainingCheckpoint, KeepsTheLastKAndFindsTheLatest) {
  launch::RunConfig run = MakeRun("fp32", {"train.steps=5"});
  const fs::path dir = FreshDir("keep");
  auto data = TokenDataset::FromText(launch::ShippedCorpus(), run.seq_len, "corpus");
  ASSERT_TRUE(data.ok());
  auto model = MoeModel::Create(run.model, run.runtime, run.train.seed);
  ASSERT_TRUE(model.ok());
  Trainer trainer(**model, *data, run.train);
  CheckpointingOptions o = Options(run, dir);
  o.save_every_steps = 1;
  o.keep_last = 2;
  // Left by a save that was killed (of a step this run never reaches).
  fs::create_directories(dir / ".step-00000099.partial");
  Checkpointer checkpointer(trainer, o, std::cerr);
  std::ostringstream log;
  ASSERT_TRUE(trainer.Run(log, {}, checkpointer.Hook()).ok());
  EXPECT_EQ(Listing(dir), (std::vector<std::string>{"step-00000004", "step-00000005"}));
  // An incomplete directory (no manifest) is never "latest".
  fs::create_directories(dir / "step-00000009");
  auto latest = ResolveResumeDir("latest", dir.string());
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->filename(), "step-00000005");
  EXPECT_FALSE(ResolveResumeDir("latest", (dir / "none").string()).ok());
}

TEST(TrainingCheckpoint, SavesByTimeAndAfterTheLastStep) {
  const launch::RunConfig run = MakeRun("fp32", {"train.steps=3"});
  auto data = TokenDataset::FromText(launch::ShippedCorpus(), run.seq_len, "corpus");
  ASSERT_TRUE(data.ok());
  for (const double minutes : {1e-9, 60.0}) {
    const fs::path dir = FreshDir("time");
    auto model = MoeModel::Create(run.model, run.runtime, run.train.seed);
    ASSERT_TRUE(model.ok());
    Trainer trainer(**model, *data, run.train);
    CheckpointingOptions o = Options(run, dir);
    o.save_every_minutes = minutes;
    Checkpointer checkpointer(trainer, o, std::cerr);
    std::ostringstream log;
    ASSERT_TRUE(trainer.Run(log, {}, checkpointer.Hook()).ok());
    EXPECT_EQ(checkpointer.last_saved_step(), 3);
    EXPECT_FALSE(checkpointer.stopped());
    if (minutes < 1) {  // due after every step
      EXPECT_EQ(Listing(dir),
                (std::vector<std::string>{"step-00000001", "step-00000002", "step-00000003"}));
    } else {  // never due: only the final checkpoint
      EXPECT_EQ(Listing(dir), (std::vector<std::string>{"step-00000003"}));
    }
  }
}

TEST(TrainingCheckpoint, ExportWritesTheTrainedModel) {
  const launch::RunConfig run = MakeRun("bf16");
  const fs::path dir = FreshDir("export");
  const Result trained = Train(run, dir);  // stopped after step 4, saved
  const fs::path hf = FreshDir("export_hf");
  std::ostringstream log;
  const absl::Status s =
      launch::RunExport((dir / checkpoint::StepDirName(kStopAt)).string(), hf.string(), {},
                        parallel::LocalCommunicator::Create("world"), log);
  ASSERT_TRUE(s.ok()) << s;
  // Loaded back: the weights of step 4 (the bfloat16 experts' float32 masters
  // are written as trained, in float32).
  auto model = MoeModel::Create(run.model, run.runtime, run.train.seed, WeightInit::kUninitialized);
  ASSERT_TRUE(model.ok());
  ASSERT_TRUE(LoadPretrained(**model, hf.string()).ok());
  int compared = 0;
  for (const Parameter& p : (*model)->named_tensors()) {
    ASSERT_TRUE(trained.tensors.count(p.name)) << p.name;
    EXPECT_TRUE(at::equal(p.tensor, trained.tensors.at(p.name))) << p.name;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int>(trained.tensors.size()));
}

// Load errors, each on a copy of one saved checkpoint.
class LoadErrors : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    saved_ = new fs::path(FreshDir("errors"));
    Train(MakeRun("fp32"), *saved_);
  }
  static void TearDownTestSuite() { delete saved_; }

  // A fresh copy of the checkpoint.
  fs::path Copy(const std::string& name) {
    const fs::path dir = FreshDir("err_" + name);
    fs::create_directories(dir);
    fs::copy(*saved_ / checkpoint::StepDirName(kStopAt), dir, fs::copy_options::recursive);
    return dir;
  }

  absl::Status Load(const fs::path& dir, const std::vector<std::string>& extra = {}) {
    const launch::RunConfig run = MakeRun("fp32", extra);
    auto data = TokenDataset::FromText(launch::ShippedCorpus(), run.seq_len, "corpus");
    EXPECT_TRUE(data.ok());
    auto model = MoeModel::Create(run.model, run.runtime, run.train.seed);
    EXPECT_TRUE(model.ok());
    Trainer trainer(**model, *data, run.train);
    absl::Status s = LoadTrainingCheckpoint(trainer, dir, &run.model_config).status();
    std::cout << "[ message ] " << s.message() << std::endl;
    return s;
  }

  static void FlipByte(const fs::path& file, int64_t offset_from_end) {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-offset_from_end, std::ios::end);
    char c;
    f.get(c);
    f.seekp(-offset_from_end, std::ios::end);
    f.put(static_cast<char>(c ^ 0x10));
  }

  static fs::path* saved_;
};
fs::path* LoadErrors::saved_ = nullptr;

TEST_F(LoadErrors, TheCopyLoads) { EXPECT_TRUE(Load(Copy("ok")).ok()); }

TEST_F(LoadErrors, FlippedByteInAnExpertShardNamesTheFile) {
  const fs::path dir = Copy("flip");
  FlipByte(dir / "experts-00000-of-00001.safetensors", 100);
  const absl::Status s = Load(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("checksum mismatch"), std::string::npos) << s;
  EXPECT_NE(s.message().find("experts-00000-of-00001.safetensors"), std::string::npos) << s;
}

TEST_F(LoadErrors, FlippedByteInTheMiddleOfAShardNamesTheFile) {
  // Early in the file: the loader reads on while checking, and still reports it.
  const fs::path dir = Copy("flip_middle");
  const fs::path shard = dir / "experts-00000-of-00001.safetensors";
  FlipByte(shard, static_cast<int64_t>(fs::file_size(shard) / 2));
  const absl::Status s = Load(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("checksum mismatch"), std::string::npos) << s;
  EXPECT_NE(s.message().find("experts-00000-of-00001.safetensors"), std::string::npos) << s;
}

TEST_F(LoadErrors, FlippedByteInADenseHeaderNamesTheFile) {
  const fs::path dir = Copy("flip_header");
  std::fstream f(dir / "dense.safetensors", std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(20);
  f.put('#');
  f.close();
  const absl::Status s = Load(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("dense.safetensors"), std::string::npos) << s;
}

TEST_F(LoadErrors, MissingShardIsNamed) {
  const fs::path dir = Copy("missing");
  fs::remove(dir / "experts-00000-of-00001.safetensors");
  const absl::Status s = Load(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("experts-00000-of-00001.safetensors"), std::string::npos) << s;
}

TEST_F(LoadErrors, TruncatedManifestIsNamed) {
  const fs::path dir = Copy("truncated");
  const fs::path manifest = dir / checkpoint::kManifestName;
  fs::resize_file(manifest, fs::file_size(manifest) / 2);
  const absl::Status s = Load(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("manifest.binpb"), std::string::npos) << s;
}

TEST_F(LoadErrors, ManifestCutAtAFieldBoundaryIsNamed) {
  // Without its last field (the end mark, 2 bytes) the rest still parses.
  const fs::path dir = Copy("cut");
  const fs::path manifest = dir / checkpoint::kManifestName;
  fs::resize_file(manifest, fs::file_size(manifest) - 2);
  const absl::Status s = Load(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("manifest.binpb is truncated"), std::string::npos) << s;
}

TEST_F(LoadErrors, OtherFormatVersionIsRefused) {
  const fs::path dir = Copy("version");
  auto m = checkpoint::ReadManifest(dir);
  ASSERT_TRUE(m.ok());
  m->set_format_version(checkpoint::kTrainingCheckpointFormatVersion + 1);
  ASSERT_TRUE(checkpoint::WriteManifest(dir, *m).ok());
  const absl::Status s = Load(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("format_version 2"), std::string::npos) << s;
}

TEST_F(LoadErrors, AnotherModelNamesTheField) {
  const absl::Status s = Load(Copy("model"), {"model.moe_intermediate_size=48"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("model.moe_intermediate_size"), std::string::npos) << s;
}

TEST_F(LoadErrors, AnotherGlobalBatchIsRefused) {
  const absl::Status s = Load(Copy("batch"), {"train.micro_batch_size=2"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("train.micro_batch_size"), std::string::npos) << s;
}

}  // namespace
}  // namespace moefit::framework
