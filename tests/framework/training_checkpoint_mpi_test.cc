// Training checkpoints across world sizes, under mpirun -np 3 and -np 4.
//
// Ranks 0 and 1 train a 2-process run (expert parallel over both: 4 experts
// each) for 10 steps as the reference, then again with rank 1 alone asking
// to stop after step 5: both ranks must agree to stop and save. The
// checkpoint is then resumed at 2 processes (bitwise the reference's
// losses), at every rank of the world (3 or 4: experts 3+3+2 or 2+2+2+2, so
// ranks read rows from both saved expert files; at 4 also with ep_size 2,
// two copies of the experts) and at 1 process, each
// within 1e-5 relative of the reference over the 5 steps after the resume,
// balance loss on. Then reshard round trips: the checkpoint loaded at the
// world size (at 4 also with ep_size 2, whose replica ranks save no experts),
// saved, loaded at 2 and saved again holds every expert tensor and AdamW
// moment of the original bit for bit; and `moefit reshard` offline writes the
// same expert files as the world-size save, and resumes alike.
//
// The global batch is 12 sequences at every size (micro-batch 12 / ranks).
// AdamW's eps is 1e-4 for the reason given in ep_training_test.cc: at another
// world size the sums run in another order, and with eps = 1e-8 the update of
// elements whose gradient is ~0 would amplify that rounding.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "checkpoint/safetensors.h"
#include "checkpoint/training_manifest.h"
#include "framework/data.h"
#include "framework/model.h"
#include "framework/trainer.h"
#include "framework/training_checkpoint.h"
#include "launch/config.h"
#include "launch/corpus.h"
#include "launch/reshard_command.h"
#include "parallel/local_communicator.h"
#include "parallel/process_groups.h"
#include "tests/framework/test_configs.h"
#include "tests/parallel/mpi_test_env.h"

namespace moefit::framework {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kSteps = 10;
constexpr int64_t kStopAt = 5;
constexpr int64_t kGlobalBatch = 12;

launch::RunConfig SmallRun(int world_size) {
  launch::RunConfig run = DemoRunConfig(
      {"train.steps=" + std::to_string(kSteps), "train.seq_len=32", "model.hidden_size=64",
       "model.head_dim=16", "model.moe_intermediate_size=32", "model.num_hidden_layers=2",
       "logging.metrics_file=", "schedule.warmup_steps=2", "optimizer.eps=1e-4",
       "train.micro_batch_size=" + std::to_string(kGlobalBatch / world_size)});
  run.runtime.expert_master_weights = true;
  return run;
}

struct Job {
  fs::path save_dir;         // checkpointing into it, stopping at kStopAt when asked
  bool stop_here = false;    // this rank asks to stop after kStopAt
  fs::path resume;           // resume from it
  fs::path save_after_load;  // save the loaded state here without training
  int ep_size = 0;           // parallel.ep_size (0 = the world)
};

std::vector<double> Train(std::shared_ptr<parallel::Communicator> world, const Job& job) {
  launch::RunConfig run = SmallRun(world->size());
  auto groups = parallel::MakeProcessGroups(world, {.ep_size = job.ep_size});
  EXPECT_TRUE(groups.ok()) << groups.status();
  run.runtime.expert_group = groups->expert_parallel;
  auto data = TokenDataset::FromText(launch::ShippedCorpus(), run.seq_len, "corpus");
  EXPECT_TRUE(data.ok()) << data.status();
  auto model =
      MoeModel::Create(run.model, run.runtime, run.train.seed,
                       job.resume.empty() ? WeightInit::kRandom : WeightInit::kUninitialized);
  EXPECT_TRUE(model.ok()) << model.status();
  Trainer trainer(**model, *data, run.train, &*groups);
  if (!job.resume.empty()) {
    auto step = LoadTrainingCheckpoint(trainer, job.resume, &run.model_config);
    EXPECT_TRUE(step.ok()) << step.status();
  }
  CheckpointingOptions o;
  o.config_text = run.config_text;
  o.model_config = run.model_config;
  if (!job.save_after_load.empty()) {
    o.save_dir = job.save_after_load.string();
    EXPECT_TRUE(SaveTrainingCheckpoint(trainer, kStopAt, o).ok());
    return {};
  }
  o.save_dir = job.save_dir.string();
  Checkpointer checkpointer(trainer, o, std::cerr);
  std::vector<double> losses;
  auto after = [&](const StepStats& st) {
    losses.push_back(st.loss);
    if (job.stop_here && st.step == kStopAt) RequestStop();
  };
  std::ostringstream log;
  auto stats = trainer.Run(log, after, job.save_dir.empty() ? StepEndHook() : checkpointer.Hook());
  ClearStopRequest();
  EXPECT_TRUE(stats.ok()) << stats.status();
  return losses;
}

void ExpectClose(const std::vector<double>& resumed, const std::vector<double>& reference,
                 const std::string& what) {
  ASSERT_EQ(resumed.size(), static_cast<size_t>(kSteps - kStopAt)) << what;
  double worst = 0;
  for (int64_t s = 0; s < kSteps - kStopAt; ++s) {
    const double want = reference[kStopAt + s];
    EXPECT_NEAR(resumed[s], want, 1e-5 * want) << what << ", step " << kStopAt + s + 1;
    worst = std::max(worst, std::abs(resumed[s] - want) / want);
  }
  if (parallel::testing::World()->rank() == 0) {
    std::printf("[ rank 0 ] %s: largest relative loss difference %.3g\n", what.c_str(), worst);
  }
}

// The two safetensors files hold the same tensors, byte for byte; adds the
// number compared to *compared. A function of its own, so that its ASSERTs
// leave only it: the callers go on to collectives.
void ExpectSameTensors(const fs::path& a_path, const fs::path& b_path, int* compared) {
  auto a = checkpoint::SafetensorsFile::Open(a_path);
  auto b = checkpoint::SafetensorsFile::Open(b_path);
  ASSERT_TRUE(a.ok() && b.ok()) << a_path << ", " << b_path;
  ASSERT_EQ(a->num_tensors(), b->num_tensors());
  for (const auto& info : a->tensors()) {
    const auto* other = b->Find(info.name);
    ASSERT_NE(other, nullptr) << info.name;
    const auto x = a->TensorBytes(info), y = b->TensorBytes(*other);
    ASSERT_EQ(x.size(), y.size()) << info.name;
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size()), 0) << b_path << ": " << info.name;
    ++*compared;
  }
}

TEST(TrainingCheckpointMpi, SaveAtTwoResumeAtTwoWorldAndOne) {
  auto world = parallel::testing::World();
  const int rank = world->rank();
  const fs::path root =
      fs::temp_directory_path() / ("moefit_ckpt_mpi_np" + std::to_string(world->size()));
  if (rank == 0) {
    fs::remove_all(root);
    fs::create_directories(root);
  }
  world->Barrier()->WaitOrThrow();
  const fs::path saved = root / "two";
  const fs::path ckpt = saved / checkpoint::StepDirName(kStopAt);
  auto two = world->Split(rank < 2 ? 0 : -1, rank, "two");
  ASSERT_TRUE(two.ok());

  std::vector<double> reference;
  if (rank < 2) {
    reference = Train(*two, {});
    EXPECT_EQ(reference.size(), static_cast<size_t>(kSteps));
    reference.resize(kSteps);  // zeros past a short run: the checks below fail, not crash
    const std::vector<double> first = Train(*two, {.save_dir = saved, .stop_here = rank == 1});
    // Both ranks stopped after step 5 (only rank 1 asked), with equal losses.
    EXPECT_EQ(first.size(), static_cast<size_t>(kStopAt));
    for (size_t s = 0; s < std::min(first.size(), static_cast<size_t>(kStopAt)); ++s) {
      EXPECT_EQ(first[s], reference[s]);
    }
  }
  world->Barrier()->WaitOrThrow();
  auto manifest = checkpoint::ReadManifest(ckpt);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->layout().world_size(), 2);
  EXPECT_EQ(manifest->layout().ep_size(), 2);
  int num_expert_files = 0;
  for (const auto& f : manifest->files()) {
    if (f.path().starts_with("experts-")) {
      ++num_expert_files;
      EXPECT_EQ(f.written_by_rank(), f.path() == "experts-00000-of-00002.safetensors" ? 0 : 1);
      for (const auto& t : f.tensors()) EXPECT_EQ(t.expert_end() - t.expert_begin(), 4);
    }
  }
  EXPECT_EQ(num_expert_files, 2);

  if (rank < 2) {
    // Same world size: bitwise.
    const std::vector<double> resumed = Train(*two, {.resume = ckpt});
    EXPECT_EQ(resumed.size(), static_cast<size_t>(kSteps - kStopAt));
    for (size_t s = 0; s < std::min(resumed.size(), static_cast<size_t>(kSteps - kStopAt)); ++s) {
      EXPECT_EQ(resumed[s], reference[kStopAt + s]) << "step " << kStopAt + s + 1;
    }
  }
  const std::vector<double> at_world = Train(world, {.resume = ckpt});
  // Reference losses from rank 0 to every rank.
  at::Tensor ref = at::zeros({kSteps}, at::kDouble);
  if (rank == 0) ref.copy_(at::tensor(reference, at::kDouble));
  world->Broadcast(ref, 0)->WaitOrThrow();
  std::vector<double> ref_all(ref.data_ptr<double>(), ref.data_ptr<double>() + kSteps);
  ExpectClose(at_world, ref_all, "resumed at " + std::to_string(world->size()));
  if (world->size() == 4) {
    // Expert data parallelism: two copies of the experts, each over 2 ranks;
    // only the first copy's ranks would save them, every rank reads its own.
    ExpectClose(Train(world, {.resume = ckpt, .ep_size = 2}), ref_all,
                "resumed at 4 with ep_size 2");
  }
  if (rank == 0) {
    ExpectClose(Train(parallel::LocalCommunicator::Create(), {.resume = ckpt}), ref_all,
                "resumed at 1");
  }

  // Reshard round trips: 2 -> world -> 2, no training in between (at 4 ranks
  // also through ep_size 2, where only the first copy's ranks save experts).
  std::vector<int> ep_sizes = {0};
  if (world->size() == 4) ep_sizes.push_back(2);
  for (const int ep_size : ep_sizes) {
    const fs::path there = root / ("there_ep" + std::to_string(ep_size));
    const fs::path back_again = root / ("back_ep" + std::to_string(ep_size));
    Train(world, {.resume = ckpt, .save_after_load = there, .ep_size = ep_size});
    world->Barrier()->WaitOrThrow();
    if (rank < 2) {
      Train(*two,
            {.resume = there / checkpoint::StepDirName(kStopAt), .save_after_load = back_again});
    }
    world->Barrier()->WaitOrThrow();
    // EXPECTs, not ASSERTs: every rank must reach the barrier below.
    if (rank == 0) {
      auto there_manifest = checkpoint::ReadManifest(there / checkpoint::StepDirName(kStopAt));
      EXPECT_TRUE(there_manifest.ok()) << there_manifest.status();
      if (there_manifest.ok()) {
        EXPECT_EQ(there_manifest->layout().ep_size(), ep_size == 0 ? world->size() : ep_size);
      }
      int compared = 0;
      for (int r = 0; r < 2; ++r) {
        const std::string name = "experts-0000" + std::to_string(r) + "-of-00002.safetensors";
        ExpectSameTensors(ckpt / name, back_again / checkpoint::StepDirName(kStopAt) / name,
                          &compared);
      }
      // gate_up and down of 2 layers, each with 2 moments, in both files.
      EXPECT_EQ(compared, 2 * 2 * 3 * 2) << "ep_size " << ep_size;
    }
    world->Barrier()->WaitOrThrow();
  }
  if (world->size() == 4 && rank == 0) {
    // Replicas wrote no expert files: two, by world ranks 0 and 1.
    auto m = checkpoint::ReadManifest(root / "there_ep2" / checkpoint::StepDirName(kStopAt));
    EXPECT_TRUE(m.ok()) << m.status();
    int expert_files = 0;
    for (int i = 0; m.ok() && i < m->files_size(); ++i) {
      if (m->files(i).path().starts_with("experts-")) {
        ++expert_files;
        EXPECT_LT(m->files(i).written_by_rank(), 2) << m->files(i).path();
      }
    }
    EXPECT_EQ(expert_files, 2);
  }
  const fs::path resharded = root / "there_ep0";

  // Offline: `moefit reshard` of the 2-rank checkpoint to the world size
  // writes the expert files the world-size run saved, and resuming from it
  // gives bitwise the losses of resuming from the original at that size.
  const fs::path offline = root / "offline";
  std::ostringstream log;
  EXPECT_TRUE(launch::RunReshard(ckpt.string(), offline.string(), world->size(), world, log).ok());
  auto offline_manifest = checkpoint::ReadManifest(offline);
  EXPECT_TRUE(offline_manifest.ok()) << offline_manifest.status();
  if (offline_manifest.ok()) {
    EXPECT_EQ(offline_manifest->layout().ep_size(), world->size());
  }
  // Each rank compares the file of its own experts.
  const std::string name = "experts-0000" + std::to_string(rank) + "-of-0000" +
                           std::to_string(world->size()) + ".safetensors";
  int compared = 0;
  ExpectSameTensors(resharded / checkpoint::StepDirName(kStopAt) / name, offline / name, &compared);
  const std::vector<double> from_offline = Train(world, {.resume = offline});
  EXPECT_EQ(from_offline.size(), at_world.size());
  for (size_t s = 0; s < std::min(from_offline.size(), at_world.size()); ++s) {
    EXPECT_EQ(from_offline[s], at_world[s]);
  }
  world->Barrier()->WaitOrThrow();
}

}  // namespace
}  // namespace moefit::framework
