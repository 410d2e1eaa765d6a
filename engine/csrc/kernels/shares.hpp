// Contiguous shares of a parallel loop that balance themselves at the end. Each thread starts on
// its own equal share, in memory order (what schedule(static) gives it, so its weight stream and
// the chunk it prefetches next are unchanged), and a thread done with its share takes chunks from
// the back of the share with the most left. A static split waits at the region's barrier for its
// slowest thread, and on a shared VM that is a different thread from one GEMM to the next (a busy
// hyperthread sibling on the host, an interrupt): profiled on a 2-vCPU AMD EPYC Zen 3, a float32
// 128-token prefill's threads spent 10% and 17% of their time in OpenMP's barrier with GEMMs of
// equal shares. Against that static split, one binary switching between the two in one process
// (medians of rounds taking turns, float32): 128-token prefill 322 -> 276 ms (16 rounds),
// 2,048-token prefill 5.95 -> 5.26 s (4), 64 prompts x 128 tokens, 64 out 121 -> 135 tok/s (4);
// bfloat16 128-token prefill 219 -> 198 ms (8). Batch-1 decode, bound by memory, is unchanged
// (10.6-10.8 ms bfloat16, 17.1-17.4 float32; handing out 4-panel items dynamically gained nothing
// either). The GGUF-block and int8 GEMMs (quant.hpp, qdot.hpp, int8.hpp, gated_gemm.hpp) run the
// same way; against their static splits, on the default Q4_1 model (same VM, same method):
// 128-token prefill 284 -> 254 ms (12 of 12 rounds), 64 x 128 tokens, 32 out 85 -> 106 tok/s (3
// of 4), batch-1 decode 10.4 -> 9.6 ms (11 of 12, where the float GEMV's did not move); with int8
// activations 64 x 128 / 32 122 -> 127 tok/s (3 of 4), batch 1 and 128-token prefill level.
// Which thread computes a chunk never changes its bits: every output element is computed the
// same way by whichever thread takes it.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>
#include <omp.h>

namespace cpuserve {
namespace {

class Shares {
 public:
  // items [0, n) in `threads` equal contiguous shares
  Shares(int64_t n, int threads) : threads_(std::max(threads, 1)) {
    static thread_local std::unique_ptr<Range[]> ranges;
    static thread_local int capacity = 0;
    if (capacity < threads_) {
      ranges.reset(new Range[threads_]);
      capacity = threads_;
    }
    r_ = ranges.get();
    const int64_t per = (n + threads_ - 1) / threads_;
    for (int t = 0; t < threads_; ++t) {
      const int64_t lo = std::min(n, t * per), hi = std::min(n, lo + per);
      r_[t].fb.store(pack(lo, hi), std::memory_order_relaxed);
    }
  }

  // Thread t of the team: run(lo, hi) over chunks of at most `chunk` items, its own share from the
  // front, then the others' from the back, until none is left. Every item runs exactly once, also
  // where the team has fewer threads than planned (a missing thread's share is taken whole).
  template <typename Run>
  void run(int t, int64_t chunk, Run&& run) {
    int64_t lo, hi;
    if (t < threads_)
      while (take(r_[t], false, chunk, lo, hi)) run(lo, hi);
    for (;;) {
      int victim = -1;
      int64_t most = 0;
      for (int v = 0; v < threads_; ++v) {
        const uint64_t x = r_[v].fb.load(std::memory_order_relaxed);
        if (back(x) - front(x) > most) most = back(x) - front(x), victim = v;
      }
      if (victim < 0) return;
      if (take(r_[victim], true, chunk, lo, hi)) run(lo, hi);
    }
  }

 private:
  struct alignas(64) Range {
    std::atomic<uint64_t> fb;  // front << 32 | back: the share's items not yet taken
  };
  static uint64_t pack(int64_t f, int64_t b) { return static_cast<uint64_t>(f) << 32 | static_cast<uint64_t>(b); }
  static int64_t front(uint64_t x) { return static_cast<int64_t>(x >> 32); }
  static int64_t back(uint64_t x) { return static_cast<int64_t>(x & 0xffffffffu); }

  // up to `chunk` items from the front (or the back) of r; false where it is empty
  static bool take(Range& r, bool from_back, int64_t chunk, int64_t& lo, int64_t& hi) {
    uint64_t x = r.fb.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = front(x), b = back(x);
      if (f >= b) return false;
      const int64_t c = std::min(chunk, b - f);
      const uint64_t y = from_back ? pack(f, b - c) : pack(f + c, b);
      if (r.fb.compare_exchange_weak(x, y, std::memory_order_acq_rel, std::memory_order_relaxed)) {
        lo = from_back ? b - c : f;
        hi = from_back ? b : f + c;
        return true;
      }
    }
  }

  int threads_;
  Range* r_;
};

// A GEMM's work over row tiles x panels (item mt * panels + p) in self-balancing thread shares:
// each thread streams its own contiguous share of the panels in memory order, as the
// static split before did (a few panels a group had left one thread with twice the other's bytes
// on 18-panel layers), then helps with the others'; run(mt, p0, p1) per chunk of one row tile,
// then done() once on each thread of the team, after its last chunk (or none).
template <typename Run, typename Done>
inline void share_tiles(int64_t m_tiles, int64_t panels, int64_t chunk, bool parallel, Run&& run, Done&& done) {
  const int team = parallel ? omp_get_max_threads() : 1;
  Shares shares(m_tiles * panels, team);
#pragma omp parallel num_threads(team) if (team > 1)
  {
    shares.run(omp_get_thread_num(), chunk, [&](int64_t lo, int64_t hi) {
      while (lo < hi) {  // a chunk across the end of a row tile: its two parts
        const int64_t mt = lo / panels, end = std::min(hi, (mt + 1) * panels);
        run(mt, lo - mt * panels, end - mt * panels);
        lo = end;
      }
    });
    done();
  }
}

template <typename Run>
inline void share_tiles(int64_t m_tiles, int64_t panels, int64_t chunk, bool parallel, Run&& run) {
  share_tiles(m_tiles, panels, chunk, parallel, std::forward<Run>(run), [] {});
}

// When `threads` threads finish n items of the given costs, each thread taking the list's next item
// as soon as it is free (an atomic counter, as paged attention claims its items): the finish of
// the last, in the costs' units. The list is taken in order, so its order matters: one long item
// last leaves the other threads idle while it runs.
template <typename Cost>
inline double claimed_finish(int64_t n, int64_t threads, Cost&& cost) {
  static thread_local std::vector<double> free_at;  // a min-heap of the threads' next free times
  free_at.assign(static_cast<size_t>(std::max<int64_t>(threads, 1)), 0.0);
  double last = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    std::pop_heap(free_at.begin(), free_at.end(), std::greater<>());
    free_at.back() += cost(i);
    last = std::max(last, free_at.back());
    std::push_heap(free_at.begin(), free_at.end(), std::greater<>());
  }
  return last;
}

}  // namespace
}  // namespace cpuserve
