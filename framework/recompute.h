// Activation recomputation ("activation checkpointing"): a block's forward
// keeps only its inputs, and its intermediate activations are computed again
// when the backward reaches it, trading one more forward of the block for the
// memory of its activations. Reentrant, as torch.utils.checkpoint with
// use_reentrant=True: the recomputed graph is back-propagated inside the
// outer backward, by a nested backward call.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace moefit::framework {

using RecomputeFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Runs `fn(inputs)` without keeping its intermediate activations: the forward
// runs under no-grad and only `inputs` are saved; when the backward reaches
// this point, `fn` is run again with grad enabled on the saved inputs
// (detached, requires_grad as the originals) and its graph is back-propagated
// at once: gradients reach the inputs (returned to the outer graph) and every
// leaf tensor `fn` uses internally (e.g. parameters captured by the lambda),
// whose .grad is accumulated by that inner backward exactly as without
// recomputation.
//
// Outputs: any number of tensors; undefined or non-differentiable (e.g.
// integer) outputs are allowed (their grads ignored). Outputs that receive no
// gradient are left out of the inner backward, as nothing flows from them in
// the plain run either: a parameter only they use keeps an undefined .grad
// rather than getting zeros. The outer graph gets the forward's outputs,
// never the recomputed ones. Inputs may be undefined or non-floating (e.g.
// token positions): they are passed through as they are.
//
// The random number state of the CPU default generator (and of the CUDA
// default generator of each CUDA device among the inputs) is saved before the
// forward and restored for the recomputation, so dropout draws the same masks;
// the generators' state after the recomputation is the one it found.
//
// If grad mode is off, fn simply runs once. With grad mode on, the parameters
// fn captures cannot be seen from here, so the result always goes through the
// recomputation node, anchored in the graph by a dummy tensor that requires
// grad: this is what makes captured parameters get their gradients when no
// input requires grad (a reentrant node needs an input that requires grad to
// be in the graph at all). A fn that uses nothing requiring grad then returns
// outputs that require grad, and costs a recomputation that yields no
// gradient if a backward reaches it.
//
// Requirements on fn: it is copied and kept until the backward (whatever it
// captures by reference must live that long); it must return the same number
// of outputs, defined at the same positions, every time; it must not modify
// its inputs in place (checked); its other effects happen twice. Nested use
// (Recomputed inside a recomputed fn) is supported. Refused with an error:
// torch::autograd::grad and backward(inputs=...) (the inner backward
// accumulates into the .grad of every leaf it reaches, which those calls must
// leave alone), and double backward (create_graph). The autocast state is not
// saved: the recomputation runs under the state of the backward.
std::vector<at::Tensor> Recomputed(const RecomputeFn& fn, const std::vector<at::Tensor>& inputs);

}  // namespace moefit::framework
