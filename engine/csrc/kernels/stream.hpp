// The machine's read bandwidth, as the decode GEMV sees it: every thread streams its own
// contiguous share of a buffer through vector loads into four independent sums (enough
// loads in flight to saturate the memory system, no arithmetic bound), the next lines asked for
// as the GEMV asks for its weights' (DecodeFetch, prefetch.hpp): marked non-temporal, or (kL2Ahead)
// left to the hardware prefetchers, which follow one stream a thread as they do not follow the
// GEMV's four (1 or 2 KB ahead into L2: 1.11x and 0.98x the time of plain loads on the Xeon with
// AMX), so that the bound it gives is measured the way the GEMV reads.
#pragma once
#include <omp.h>
#include "../vec/vec.hpp"
#include "prefetch.hpp"

namespace cpuserve {
namespace {

template <DecodeFetch F>
float read_sum_range(const float* x, int64_t lo, int64_t hi) {
  VecF s0 = VecF::zero(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = lo;
  for (; i + 4 * VecF::N <= hi; i += 4 * VecF::N) {
    if constexpr (F == DecodeFetch::kNonTemporal)
      for (int64_t o = 4 * VecF::N; o < 8 * VecF::N; o += 16) prefetch_nta(x + i + o);
    s0 = s0 + VecF::load(x + i);
    s1 = s1 + VecF::load(x + i + VecF::N);
    s2 = s2 + VecF::load(x + i + 2 * VecF::N);
    s3 = s3 + VecF::load(x + i + 3 * VecF::N);
  }
  float s = ((s0 + s1) + (s2 + s3)).reduce_sum();
  for (; i < hi; ++i) s += x[i];
  return s;
}

// The sum of x[0, n) (the order of the additions depends on the thread count).
float read_sum_impl(const float* x, int64_t n) {
  float total = 0.f;
  const bool nta = decode_fetch() == DecodeFetch::kNonTemporal;
#pragma omp parallel reduction(+ : total)
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    // shares aligned to 64 floats, so that each thread's loads start on a cache line
    const int64_t lo = n * id / nt / 64 * 64, hi = id + 1 == nt ? n : n * (id + 1) / nt / 64 * 64;
    total += nta ? read_sum_range<DecodeFetch::kNonTemporal>(x, lo, hi)
                 : read_sum_range<DecodeFetch::kL2Ahead>(x, lo, hi);
  }
  return total;
}

}  // namespace
}  // namespace cpuserve
