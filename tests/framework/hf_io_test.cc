// HF model directories with expert parallelism (mpirun -np 2): a model saved
// from memory loads back on every rank with each rank reading only the dense
// tensors and its own experts' bytes (counted by the loader), the loaded
// weights equal the in-memory ones, and the expert-parallel model computes the
// logits of the one-process model it was saved from.
#include "framework/hf_io.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "framework/model.h"
#include "framework/output_dir.h"
#include "launch/config.h"
#include "parallel/local_communicator.h"
#include "parallel/process_groups.h"
#include "tests/parallel/mpi_test_env.h"

namespace moefit::framework {
namespace {

launch::RunConfig SmallModel() {
  auto c = launch::LoadConfig("", {"model.hidden_size=64", "model.head_dim=16",
                                   "model.moe_intermediate_size=32", "model.num_hidden_layers=2",
                                   "model.num_experts=6", "model.mlp_only_layers=[1]",
                                   "model.intermediate_size=48"});
  EXPECT_TRUE(c.ok()) << c.status();
  auto r = launch::ResolveConfig(*c);
  EXPECT_TRUE(r.ok()) << r.status();
  return *r;
}

// The same path on every rank: rank 0 makes it, the others receive it.
std::string SharedTempDir(parallel::Communicator& world) {
  std::string dir(256, '\0');
  if (world.rank() == 0) {
    std::string tmpl = ::testing::TempDir() + "/moefit_hf_io_XXXXXX";
    const char* made = mkdtemp(tmpl.data());
    EXPECT_NE(made, nullptr);
    dir.replace(0, tmpl.size(), tmpl);
  }
  at::Tensor buf = at::from_blob(dir.data(), {static_cast<int64_t>(dir.size())}, at::kByte);
  world.Broadcast(buf, 0)->WaitOrThrow();
  return std::string(dir.c_str());
}

// Removes a directory when it goes out of scope (on rank 0, which made it),
// also when a failed ASSERT leaves the test early.
struct RemovedAtExit {
  std::string path;
  bool owner;
  ~RemovedAtExit() {
    if (!owner) return;
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

TEST(HfDirectory, EachRankReadsItsExpertsAndTheModelMatches) {
  auto world = parallel::testing::World();
  const RemovedAtExit temp{SharedTempDir(*world), world->rank() == 0};
  const std::string dir = temp.path + "/model";
  launch::RunConfig run = SmallModel();

  // The reference: one process, weights from seed 1, saved by rank 0 alone.
  auto local = parallel::MakeProcessGroups(parallel::LocalCommunicator::Create(), {});
  ASSERT_TRUE(local.ok());
  launch::RunConfig ref_run = run;
  ref_run.runtime.expert_group = local->expert_parallel;
  auto reference = MoeModel::Create(ref_run.model, ref_run.runtime, /*seed=*/1);
  ASSERT_TRUE(reference.ok());
  absl::Status saved;
  if (world->rank() == 0) saved = SaveHfDirectory(**reference, dir, *local, {});
  EXPECT_TRUE(saved.ok()) << saved;
  ASSERT_FALSE(AnyRankFailed(*world, !saved.ok()));  // every rank stops, or none

  // Expert parallel over the world, different initial weights, then loaded.
  auto groups = parallel::MakeProcessGroups(world, {});
  ASSERT_TRUE(groups.ok());
  run.runtime.expert_group = groups->expert_parallel;
  auto model = MoeModel::Create(run.model, run.runtime, /*seed=*/2);
  ASSERT_TRUE(model.ok());
  checkpoint::LoadReport report;
  absl::Status loaded = LoadPretrained(**model, dir, &report);
  EXPECT_TRUE(loaded.ok()) << loaded << " on rank " << world->rank();
  ASSERT_FALSE(AnyRankFailed(*world, !loaded.ok()));

  uint64_t expected_bytes = 0;
  for (const Parameter& p : (*model)->parameters()) expected_bytes += p.tensor.nbytes();
  EXPECT_EQ(report.num_bytes_read, expected_bytes) << "rank " << world->rank();

  const int64_t first = (*model)->placement().first_expert(world->rank());
  const int64_t n = (*model)->placement().num_local(world->rank());
  EXPECT_EQ(n, 6 / world->size());
  for (size_t i = 0; i < (*model)->parameters().size(); ++i) {
    const Parameter& p = (*model)->parameters()[i];
    const Parameter& r = (*reference)->parameters()[i];
    ASSERT_EQ(p.name, r.name);
    at::Tensor want = p.expert ? r.tensor.narrow(0, first, n) : r.tensor;
    EXPECT_TRUE(at::equal(p.tensor, want)) << p.name << " on rank " << world->rank();
  }

  torch::NoGradGuard no_grad;
  at::Tensor ids = at::arange(64, at::kLong).view({2, 32}) * 7 % 256;
  at::Tensor got = (*model)->Forward(ids).logits;
  at::Tensor want = (*reference)->Forward(ids).logits;
  EXPECT_TRUE(at::allclose(got, want, 1e-6, 1e-6))
      << "max difference " << (got - want).abs().max().item<float>();
  world->Barrier()->WaitOrThrow();  // every rank has read the files before rank 0 removes them
}

}  // namespace
}  // namespace moefit::framework
