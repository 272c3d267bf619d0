// A caching allocator for LibTorch's host (CPU) tensors.
//
// LibTorch's default CPU allocator takes every large tensor from the system
// (glibc maps each one fresh and unmaps it on free), so each step of training
// pays a page fault and a page clear for every 4 KiB of every large
// activation, gradient and dispatch buffer it makes, on every layer. With
// many such tensors per step, that is a large share of a CPU step (and of
// moving tokens between ranks, where the rows are only copied).
//
// The caching allocator keeps freed blocks of 1 MiB and more, by size class
// (2 MiB multiples, then sixteenths of a power of two: at most 1/16 wasted),
// and hands them out again: from the second step on, a step's large tensors
// reuse the pages of the previous one. Blocks are 2 MiB aligned and advised
// for transparent huge pages. Memory held is the peak of what was in use at
// once, kept (as GPU caching allocators do); when the system refuses a new
// block, every cached block is released and the allocation retried. Smaller
// tensors go to LibTorch's default allocator.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moefit::framework {

// Makes the caching allocator LibTorch's CPU allocator from now on (tensors
// allocated before keep their own deleters); with false, it passes every new
// allocation to LibTorch's default allocator (blocks it made still come back
// to its cache). Idempotent; not to be called while other threads allocate.
void UseCachingHostAllocator(bool enable = true);

struct HostAllocatorStats {
  int64_t allocations = 0;   // large allocations served
  int64_t reused = 0;        // of which from the cache
  int64_t cached_bytes = 0;  // free blocks held now
};
HostAllocatorStats GetHostAllocatorStats();

}  // namespace moefit::framework
