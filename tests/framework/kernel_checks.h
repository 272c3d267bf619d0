// What the CPU kernel tests share: running a piece at a given LibTorch thread
// count (the kernels that promise the same bits at any thread count are run
// at one and at two), restoring the full instruction set after a test that
// held it down, and a relative error for tolerances.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "experts/kernels/isa.h"

namespace moefit::framework {

// fn() with LibTorch's intra-op pool at `threads` threads, the count restored
// after.
template <typename F>
auto AtThreads(int threads, F fn) {
  const int before = at::get_num_threads();
  at::set_num_threads(threads);
  auto result = fn();
  at::set_num_threads(before);
  return result;
}

// Gives the kernels every instruction set this CPU has again when it goes out
// of scope, however the test that held them down with LimitIsa ends.
struct FullIsaAfter {
  ~FullIsaAfter() { experts::kernels::LimitIsa(experts::kernels::DetectIsa()); }
};

// max |a - b| / max(max |b|, 1): relative to the values' size, absolute where
// they are all small (0 for two empty tensors).
inline double RelativeError(const at::Tensor& a, const at::Tensor& b) {
  if (b.numel() == 0) return a.numel() == 0 ? 0.0 : 1.0;
  const at::Tensor bd = b.to(at::kDouble);
  return (a.to(at::kDouble) - bd).abs().max().item<double>() /
         std::max(bd.abs().max().item<double>(), 1.0);
}

}  // namespace moefit::framework
