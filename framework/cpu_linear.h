// The dense layers' linear maps on the CPU in float32 on moefit's own GEMM
// (experts/kernels/gemm.h), forward and backward.
//
// Why not LibTorch's (MKL's) sgemm: at the shapes of a small model's training
// step (2048 tokens, 512 inputs, 256-512 outputs) moefit's blocked kernels
// run forward and backward at least as fast (benchmarks/framework/
// linear_bench.cc measures both), and their results do not depend on the
// thread count.
//
// Work split: the forward and the input gradient by blocks of rows (tokens),
// the weight gradient by blocks of its rows (output features), each block's
// sum over all the tokens in one call. Every output element is summed by one
// thread in an order fixed by the shapes: the same bits at any thread count,
// and each token's output and input gradient the same bits whatever else
// shares its batch (the blocked path throughout, never the few-rows one).
#pragma once

#include <ATen/core/Tensor.h>

namespace moefit::framework {

// Whether CpuLinear takes these: float32 CPU x [..., K] and weight [N, K],
// bias undefined or float32 CPU [N].
bool CpuLinearApplies(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

// x · weightᵀ (+ bias) -> [..., N], as at::linear; autograd-aware (x, weight,
// bias).
at::Tensor CpuLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

}  // namespace moefit::framework
