// Process memory figures; see process_memory.h.
#include "framework/internal/process_memory.h"

#include <c10/core/CachingDeviceAllocator.h>

#include <cstdio>
#include <cstring>

namespace moefit::framework::internal {

ProcessMemory ReadProcessMemory(c10::Device device) {
  ProcessMemory m;
  if (std::FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    long long kib = 0;  // NOLINT(runtime/int): sscanf's %lld
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      if (std::sscanf(line, "VmRSS: %lld kB", &kib) == 1) m.host_rss_bytes = kib * 1024;
      if (std::sscanf(line, "VmHWM: %lld kB", &kib) == 1) m.host_peak_bytes = kib * 1024;
    }
    std::fclose(f);
  }
  if (device.is_cuda()) {
    const c10::CachingDeviceAllocator::DeviceStats stats =
        c10::getDeviceAllocator(c10::kCUDA)->getDeviceStats(device.index());
    const auto& bytes =
        stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    m.gpu_allocated_bytes = bytes.current;
    m.gpu_peak_bytes = bytes.peak;
  }
  return m;
}

}  // namespace moefit::framework::internal
