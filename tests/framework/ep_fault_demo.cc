// A real expert-parallel training job that fails on purpose: rank 1 throws
// after step 3 while the other ranks go on into step 4's dispatch. The entry
// point catches it, as `moefit train` does, and hands it to AbortAll, which
// must end every rank with a non-zero exit within seconds (checked by the
// ctest test framework_ep_fault_np2 through tests/parallel/expect_abort.cmake).
#include <ATen/ATen.h>

#include <iostream>
#include <sstream>
#include <stdexcept>

#include "framework/data.h"
#include "framework/model.h"
#include "framework/trainer.h"
#include "launch/config.h"
#include "launch/corpus.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_runtime.h"
#include "parallel/process_groups.h"

int main(int argc, char** argv) {
  using namespace moefit;
  auto runtime = parallel::MpiRuntime::Start(&argc, &argv);
  if (!runtime.ok()) return 1;
  auto world = parallel::MpiCommunicator::Create(MPI_COMM_WORLD);
  if (!world.ok()) parallel::AbortAll(1, world.status().ToString());
  try {
    auto config = launch::LoadConfig("", {"train.steps=50", "train.micro_batch_size=2",
                                          "train.seq_len=64", "logging.metrics_file="});
    auto run = launch::ResolveConfig(*config);
    auto groups = parallel::MakeProcessGroups(*world, {});
    run->runtime.expert_group = groups->expert_parallel;
    auto data = framework::TokenDataset::FromText(launch::ShippedCorpus(), run->seq_len, "corpus");
    auto model = framework::MoeModel::Create(run->model, run->runtime, run->train.seed);
    framework::Trainer trainer(**model, *data, run->train, &*groups);
    std::ostringstream log;
    auto result = trainer.Run(log, [&](const framework::StepStats& s) {
      if ((*world)->rank() == 1 && s.step == 3) throw std::runtime_error("injected failure after step 3");
    });
    std::cerr << "rank " << (*world)->rank() << " finished without the injected failure" << std::endl;
    return 0;
  } catch (const std::exception& e) {
    parallel::AbortAll(1, std::string("rank ") + std::to_string((*world)->rank()) + ": " + e.what());
  }
}
