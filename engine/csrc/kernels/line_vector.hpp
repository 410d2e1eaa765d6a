// Scratch vectors on 64-byte (cache-line) boundaries.
#pragma once
#include <cstdlib>
#include <new>
#include <vector>

namespace cpuserve {
namespace {

// An allocator for a kernel's scratch on 64-byte (cache-line) boundaries. glibc's malloc puts a
// large block 16 bytes past a page, so every row of a rounded A there crossed a line: each 64-byte
// row of an AMX tile load read two lines (the Xeon with AMX, bfloat16 GEMMs of 512 and 2,048
// rows on the model's shapes, taking turns in one process: about 3% faster on line boundaries).
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

}  // namespace
}  // namespace cpuserve
