// What this process holds in memory now and at its peak, for the per-step
// figures of the trainer: resident host memory from /proc/self/status, and
// the dense GPU's bytes in LibTorch's caching allocator through the
// device-generic allocator interface (no CUDA header, so it builds without
// CUDA).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace moefit::framework::internal {

struct ProcessMemory {
  int64_t host_rss_bytes = 0;   // VmRSS
  int64_t host_peak_bytes = 0;  // VmHWM
  // `device`'s allocated bytes now and at their peak; 0 unless it is a GPU.
  int64_t gpu_allocated_bytes = 0;
  int64_t gpu_peak_bytes = 0;
};

// 0 for a figure the system does not give.
ProcessMemory ReadProcessMemory(c10::Device device);

}  // namespace moefit::framework::internal
