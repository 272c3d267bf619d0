// Runs moefit's model on weights and inputs written by another implementation
// and writes its logits, for tests/interop/test_reference_model.py to compare
// against the Hugging Face transformers forward.
//
//   reference_logits_tool CONFIG_JSON WEIGHTS.safetensors INPUTS.safetensors OUT.safetensors [BACKEND]
//
// WEIGHTS holds every parameter under moefit's (= transformers v5) names;
// INPUTS holds "input_ids" [B, T]; OUT receives "logits" [B, T, V] (fp32).
// Missing, unexpected or mis-shaped tensors are reported by name, exit 2.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <iostream>
#include <set>

#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_io.h"
#include "framework/model.h"
#include "launch/config.h"

int main(int argc, char** argv) {
  using namespace moefit;
  if (argc < 5) {
    std::cerr << "usage: reference_logits_tool CONFIG_JSON WEIGHTS INPUTS OUT [BACKEND]\n";
    return 2;
  }
  proto::Config config = launch::DefaultConfig();
  config.mutable_model()->set_config_json(argv[1]);
  if (argc > 5) config.mutable_experts()->set_backend(argv[5]);
  absl::Status s = launch::MergeHfConfigJson(argv[1], config.mutable_model());
  auto run = s.ok() ? launch::ResolveConfig(config) : absl::StatusOr<launch::RunConfig>(s);
  if (!run.ok()) {
    std::cerr << run.status().message() << "\n";
    return 2;
  }
  auto model = framework::MoeModel::Create(run->model, run->runtime, 0);
  auto weights = checkpoint::SafetensorsFile::Open(argv[2]);
  auto inputs = checkpoint::SafetensorsFile::Open(argv[3]);
  if (!model.ok() || !weights.ok() || !inputs.ok()) {
    std::cerr << (!model.ok() ? model.status() : !weights.ok() ? weights.status() : inputs.status())
              << "\n";
    return 2;
  }
  std::set<std::string> unexpected;
  for (const std::string& n : weights->TensorNames()) unexpected.insert(n);
  int problems = 0;
  {
    torch::NoGradGuard no_grad;
    for (const framework::Parameter& p : (*model)->parameters()) {
      unexpected.erase(p.name);
      auto t = checkpoint::ReadTensor(*weights, p.name, {.dtype = p.tensor.scalar_type()});
      if (!t.ok()) {
        std::cerr << "missing: " << p.name << " (" << t.status().message() << ")\n";
        ++problems;
      } else if (t->sizes() != p.tensor.sizes()) {
        std::cerr << "shape of " << p.name << ": file " << t->sizes() << ", model "
                  << p.tensor.sizes() << "\n";
        ++problems;
      } else {
        p.tensor.copy_(*t);
      }
    }
  }
  for (const std::string& n : unexpected) {
    std::cerr << "unexpected: " << n << "\n";
    ++problems;
  }
  if (problems > 0) return 2;
  auto ids = checkpoint::ReadTensor(*inputs, "input_ids", {.dtype = at::kLong});
  if (!ids.ok()) {
    std::cerr << ids.status().message() << "\n";
    return 2;
  }
  torch::NoGradGuard no_grad;
  at::Tensor logits = (*model)->Forward(*ids).logits.to(at::kCPU);
  absl::Status saved = checkpoint::SaveTensors(argv[4], {{"logits", logits}});
  if (!saved.ok()) {
    std::cerr << saved.message() << "\n";
    return 1;
  }
  return 0;
}
