// Helpers shared by the framework tests: the demo run config with overrides,
// training on the shipped corpus, and the central-difference check of
// gradients.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "framework/data.h"
#include "framework/model.h"
#include "framework/trainer.h"
#include "launch/config.h"
#include "launch/corpus.h"

namespace moefit::framework {

// The demo config with `sets` applied, resolved, one expert thread.
inline launch::RunConfig DemoRunConfig(const std::vector<std::string>& sets) {
  auto c = launch::LoadConfig("", sets);
  EXPECT_TRUE(c.ok()) << c.status();
  auto r = launch::ResolveConfig(*c);
  EXPECT_TRUE(r.ok()) << r.status();
  r->runtime.expert_threads = 1;
  return *r;
}

// A small DeepSeek-V3 (latent attention, grouped sigmoid routing, a dense
// first layer, the sequence-wise loss and a moving correction bias) over the
// demo config.
inline const std::vector<std::string> kSmallDeepseekV3 = {
    "model.model_type=deepseek_v3", "model.router_aux_loss_coef=0",
    "model.q_lora_rank=24",         "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=16",    "model.qk_rope_head_dim=8",
    "model.v_head_dim=16",          "model.n_group=4",
    "model.topk_group=2",           "model.first_k_dense_replace=1",
    "model.num_hidden_layers=3",    "model.aux_loss_alpha=0.01",
    "router.bias_update_rate=0.01"};

// run.train's steps of `model` on the shipped corpus (sequences of run.seq_len);
// `after_step` as Trainer::Run takes it.
inline std::vector<StepStats> TrainOnCorpus(
    MoeModel& model, const launch::RunConfig& run,
    const std::function<void(const StepStats&)>& after_step = {}) {
  auto data = TokenDataset::FromText(launch::ShippedCorpus(), run.seq_len, "corpus");
  EXPECT_TRUE(data.ok()) << data.status();
  Trainer trainer(model, *data, run.train);
  std::ostringstream log;
  auto stats = trainer.Run(log, after_step);
  EXPECT_TRUE(stats.ok()) << stats.status();
  return *stats;
}

// The largest |analytic - central difference| over every element of `t`
// (float64, with its .grad from a backward of `loss`), moving each element by
// ±eps in place.
inline double WorstCentralDifference(const at::Tensor& t, const std::function<at::Tensor()>& loss,
                                     double eps = 1e-6) {
  at::NoGradGuard no_grad;
  at::Tensor flat = t.view({-1});
  at::Tensor analytic = t.grad().view({-1});
  double worst = 0;
  for (int64_t i = 0; i < flat.numel(); ++i) {
    const double saved = flat[i].item<double>();
    flat[i] = saved + eps;
    const double up = loss().item<double>();
    flat[i] = saved - eps;
    const double down = loss().item<double>();
    flat[i] = saved;
    worst = std::max(worst, std::abs(analytic[i].item<double>() - (up - down) / (2 * eps)));
  }
  return worst;
}

}  // namespace moefit::framework
