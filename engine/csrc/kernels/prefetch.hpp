// Software prefetch of the weight bytes a batched GEMM multiplies next. A batch GEMM reuses
// each weight chunk across its row tiles, so it is compute-bound on average, but the first row
// tile over a chunk found it in DRAM and waited: the hardware prefetchers follow that tile's
// reads too closely to hide the latency. Fetching the next chunk into L2 while this one's row
// tiles run hides it (decode, where each byte is used once, is left to the hardware).
#pragma once
#include <cstdint>

namespace cpuserve {
namespace {

struct Prefetch {
  const char* base = nullptr;
  int64_t first = 0, count = 0;  // cache lines [first, first + count) from base

  static Prefetch bytes(const void* at, int64_t n) { return {static_cast<const char*>(at), 0, n / 64}; }
  // The t-th of `parts` equal slices: one a row tile.
  Prefetch slice(int64_t t, int64_t parts) const {
    const int64_t l0 = first + t * count / parts, l1 = first + (t + 1) * count / parts;
    return {base, l0, l1 - l0};
  }
  void line(int64_t i) const { __builtin_prefetch(base + 64 * i, 0, 2); }  // into L2
  void issue() const {
    for (int64_t i = first; i < first + count; ++i) line(i);
  }
};

}  // namespace
}  // namespace cpuserve
