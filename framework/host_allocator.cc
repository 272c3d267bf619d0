// The caching host allocator; see host_allocator.h.
#include "framework/host_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <atomic>
#include <bit>
#include <cstdlib>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace moefit::framework {
namespace {

constexpr size_t kMinCached = size_t{1} << 20;
constexpr size_t kAlign = size_t{2} << 20;  // a transparent huge page

// Up to 64 MiB, 2 MiB multiples; above, sixteenths of the power of two below.
size_t SizeClass(size_t n) {
  size_t size = (n + kAlign - 1) / kAlign * kAlign;
  if (size > (size_t{64} << 20)) {
    const size_t step = std::bit_floor(size) / 16;
    size = (size + step - 1) / step * step;
  }
  return size;
}

class CachingHostAllocator;
CachingHostAllocator* Instance();

// Every pointer it hands out is its own deleter's context (as the default
// allocator's are), so that LibTorch's raw_allocate / raw_deallocate -- which
// oneDNN's kernels use for their scratch memory -- work through it too. Once
// installed it stays LibTorch's CPU allocator; switched off, it hands every
// allocation to the default one, so that a raw buffer taken before the switch
// still comes back through Free.
class CachingHostAllocator final : public c10::Allocator {
 public:
  explicit CachingHostAllocator(c10::Allocator* fallback) : fallback_(fallback) {}

  void set_enabled(bool enabled) { enabled_.store(enabled); }

  c10::DataPtr allocate(size_t n) override {
    if (n < kMinCached || !enabled_.load()) return fallback_->allocate(n);
    const size_t size = SizeClass(n);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.allocations;
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        stats_.cached_bytes -= static_cast<int64_t>(size);
        ++stats_.reused;
        MarkLive(p, size);
      }
    }
    if (p == nullptr) {
      p = SystemAlloc(size);  // outside the lock: the system may take a while
      std::lock_guard<std::mutex> lock(mu_);
      MarkLive(p, size);
    }
    return {p, p, &Free, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Free; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  HostAllocatorStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  // Records `p` as handed out (mu_ held).
  void MarkLive(void* p, size_t size) {
    const bool inserted = live_.emplace(p, size).second;
    TORCH_INTERNAL_ASSERT(inserted, "host allocator: block handed out twice");
  }

  // A block of this cache goes back to it; anything else (a small
  // allocation raw_allocate took from the fallback) to the fallback.
  static void Free(void* p) {
    CachingHostAllocator& self = *Instance();
    {
      std::lock_guard<std::mutex> lock(self.mu_);
      const auto it = self.live_.find(p);
      if (it != self.live_.end()) {
        self.free_[it->second].push_back(p);
        self.stats_.cached_bytes += static_cast<int64_t>(it->second);
        self.live_.erase(it);
        return;
      }
    }
    self.fallback_->raw_deleter()(p);
  }

  void* SystemAlloc(size_t size) {
    void* p = std::aligned_alloc(kAlign, size);
    if (p == nullptr) {  // give the cache back and try once more
      ReleaseCached();
      p = std::aligned_alloc(kAlign, size);
    }
    TORCH_CHECK_WITH(OutOfMemoryError, p != nullptr, "host allocator: out of memory allocating ",
                     size, " bytes");
    madvise(p, size, MADV_HUGEPAGE);  // advice only: no error if THP is off
    return p;
  }

  void ReleaseCached() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [size, blocks] : free_) {
      for (void* p : blocks) std::free(p);
      blocks.clear();
    }
    stats_.cached_bytes = 0;
  }

  c10::Allocator* fallback_;
  std::atomic<bool> enabled_{true};
  std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // size class -> free blocks
  std::unordered_map<void*, size_t> live_;     // blocks in use -> their size class
  HostAllocatorStats stats_;
};

// Never destroyed: tensors may outlive every static.
CachingHostAllocator* Instance() {
  static auto* instance = new CachingHostAllocator(c10::GetDefaultCPUAllocator());
  return instance;
}

}  // namespace

void UseCachingHostAllocator(bool enable) {
  // Installed once (priority above the default's 0, so that it wins) and
  // never replaced: what it handed out, raw buffers included, always comes
  // back to its Free.
  static const bool installed = [] {
    c10::SetCPUAllocator(Instance(), /*priority=*/1);
    return true;
  }();
  (void)installed;
  Instance()->set_enabled(enable);
}

HostAllocatorStats GetHostAllocatorStats() { return Instance()->stats(); }

}  // namespace moefit::framework
