// Running a piece of a test at a given LibTorch thread count: the kernels
// that promise the same bits at any thread count are run at one and at two.
#pragma once

#include <ATen/Parallel.h>

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

}  // namespace moefit::framework
