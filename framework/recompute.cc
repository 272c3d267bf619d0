// Activation recomputation; see recompute.h.
#include "framework/recompute.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>

namespace moefit::framework {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One generator and a state of it.
struct GeneratorState {
  at::Generator generator;
  at::Tensor state;
};

// Generators are shared by every thread: their state is read and written
// under their mutex.
at::Tensor GetState(at::Generator& generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void SetState(at::Generator& generator, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// The states now of the default generators fn may draw from: the CPU one,
// and the CUDA one of every CUDA device among the inputs.
std::vector<GeneratorState> SaveGenerators(const variable_list& inputs) {
  std::vector<GeneratorState> saved;
  saved.push_back({at::detail::getDefaultCPUGenerator(), {}});
  std::vector<c10::Device> devices;
  for (const at::Tensor& t : inputs) {
    if (t.device().is_cuda() &&
        std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
      devices.push_back(t.device());
    }
  }
  for (const c10::Device& device : devices) {
    saved.push_back({at::globalContext().defaultGenerator(device), {}});
  }
  for (GeneratorState& s : saved) s.state = GetState(s.generator);
  return saved;
}

// Sets the generators to the saved states for its lifetime, then back to the
// states it found (also when fn throws), so that the recomputation neither
// sees nor consumes the draws made since the forward.
class GeneratorFork {
 public:
  explicit GeneratorFork(const std::vector<GeneratorState>& saved) {
    for (const GeneratorState& s : saved) {
      GeneratorState current{s.generator, {}};
      current.state = GetState(current.generator);
      found_.push_back(std::move(current));
      SetState(found_.back().generator, s.state);
    }
  }
  ~GeneratorFork() {
    for (GeneratorState& s : found_) SetState(s.generator, s.state);
  }
  GeneratorFork(const GeneratorFork&) = delete;
  GeneratorFork& operator=(const GeneratorFork&) = delete;

 private:
  std::vector<GeneratorState> found_;
};

// What the node keeps besides the saved inputs. Undefined tensors cannot go
// through a custom Function (neither as inputs nor as outputs), so only the
// defined ones do, and their positions in fn's lists are kept here.
struct RecomputeState : torch::CustomClassHolder {
  RecomputeFn fn;
  size_t num_inputs = 0;
  std::vector<size_t> input_positions;    // of the defined inputs
  std::vector<bool> input_requires_grad;  // per defined input
  std::vector<GeneratorState> generators;
  size_t num_outputs = 0;
  std::vector<size_t> output_positions;  // of the defined outputs
};

// `size` tensors, `values` at `positions` and undefined elsewhere.
std::vector<at::Tensor> Scatter(at::TensorList values, const std::vector<size_t>& positions,
                                size_t size) {
  std::vector<at::Tensor> out(size);
  for (size_t i = 0; i < positions.size(); ++i) out[positions[i]] = values[i];
  return out;
}

struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  // `anchor` is a dummy that requires grad: it puts the node in the graph
  // even when no input requires grad, for the parameters fn captures.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<RecomputeState> state,
                               const at::Tensor& /*anchor*/, at::TensorList inputs) {
    std::vector<int64_t> versions;
    for (const at::Tensor& t : inputs) {
      versions.push_back(t._version());
      state->input_requires_grad.push_back(t.requires_grad());
    }
    std::vector<at::Tensor> outputs =
        state->fn(Scatter(inputs, state->input_positions, state->num_inputs));
    for (size_t i = 0; i < inputs.size(); ++i) {
      TORCH_CHECK(inputs[i]._version() == versions[i], "Recomputed: fn modified its input ",
                  state->input_positions[i],
                  " in place; its recomputation would start from the modified value");
    }
    ctx->save_for_backward(inputs.vec());

    state->num_outputs = outputs.size();
    variable_list defined, non_differentiable;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!outputs[i].defined()) continue;
      state->output_positions.push_back(i);
      defined.push_back(outputs[i]);
      const at::ScalarType dtype = outputs[i].scalar_type();
      if (!at::isFloatingType(dtype) && !at::isComplexType(dtype)) {
        non_differentiable.push_back(outputs[i]);
      }
    }
    ctx->mark_non_differentiable(non_differentiable);
    ctx->set_materialize_grads(false);
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return defined;
  }

  // grad_outputs: one per defined output, undefined where none arrived.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    // The engine runs a backward with grad mode on exactly when create_graph.
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "Recomputed: double backward (create_graph=true) is not supported");
    TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
                "Recomputed: the backward of a recomputed block runs only from backward() "
                "without `inputs`, not from torch::autograd::grad or backward(inputs=...)");
    auto state =
        c10::static_intrusive_pointer_cast<RecomputeState>(ctx->saved_data.at("state").toCapsule());
    const variable_list saved = ctx->get_saved_variables();

    // The saved inputs as leaves of the recomputed graph.
    variable_list detached;
    for (size_t i = 0; i < saved.size(); ++i) {
      detached.push_back(saved[i].detach());
      if (state->input_requires_grad[i]) detached.back().requires_grad_(true);
    }
    std::vector<at::Tensor> outputs;
    {
      GeneratorFork fork(state->generators);
      at::AutoGradMode grad_mode(true);
      outputs = state->fn(Scatter(detached, state->input_positions, state->num_inputs));
    }
    TORCH_CHECK(outputs.size() == state->num_outputs, "Recomputed: fn returned ", outputs.size(),
                " outputs when recomputed, ", state->num_outputs, " in the forward");

    variable_list with_grad, grads;
    for (size_t k = 0; k < state->output_positions.size(); ++k) {
      const at::Tensor& out = outputs[state->output_positions[k]];
      TORCH_CHECK(out.defined(), "Recomputed: output ", state->output_positions[k],
                  " of fn is undefined when recomputed but was defined in the forward");
      if (out.requires_grad() && grad_outputs[k].defined()) {
        with_grad.push_back(out);
        grads.push_back(grad_outputs[k]);
      }
    }
    // Accumulates into the .grad of every leaf the recomputed graph reaches:
    // the detached inputs, and the parameters fn uses.
    if (!with_grad.empty()) torch::autograd::backward(with_grad, grads);

    variable_list result(2);  // the state and the anchor get none
    for (const at::Tensor& d : detached) {
      result.push_back(d.requires_grad() ? d.grad() : at::Tensor());
    }
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> Recomputed(const RecomputeFn& fn, const std::vector<at::Tensor>& inputs) {
  if (!at::GradMode::is_enabled()) return fn(inputs);
  auto state = c10::make_intrusive<RecomputeState>();
  state->fn = fn;
  state->num_inputs = inputs.size();
  variable_list defined;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    state->input_positions.push_back(i);
    defined.push_back(inputs[i]);
  }
  state->generators = SaveGenerators(defined);
  const at::Tensor anchor = at::empty({0}, at::kFloat).requires_grad_(true);
  const variable_list outputs = RecomputeFunction::apply(state, anchor, at::TensorList(defined));
  return Scatter(outputs, state->output_positions, state->num_outputs);
}

}  // namespace moefit::framework
