// Software prefetch of the weight bytes a batched GEMM multiplies next. A batch GEMM reuses
// each weight chunk across its row tiles, so it is compute-bound on average, but the first row
// tile over a chunk found it in DRAM and waited: the hardware prefetchers follow that tile's
// reads too closely to hide the latency. Fetching the next chunk into L2 while this one's row
// tiles run hides it (decode, where each byte is used once, is left to the hardware).
// LineQueue does the same for the paged attention's next cache block, whose address no hardware
// prefetcher can guess.
//
// Every prefetch here goes to L2 (prefetcht1), not L1: what is fetched ahead is a whole block or
// chunk (a float32 attention block: 64 KB of keys and values), more than L1 holds, so into L1 it
// pushed out lines still in use and its own first lines before they were read. AMD EPYC Zen 4, two
// threads, engines taking turns (medians of 5): decode attention a layer, 200 tokens of context,
// float32 16 sequences 379 -> 288 us, 64 sequences 1,433 -> 1,061, bfloat16 64 sequences 794 ->
// 718; a 2,048-token prefill's attention unchanged (30-33 ms a layer either way).
#pragma once
#include <cstdint>

namespace cpuserve {
namespace {

// A read of the cache line at p, fetched into L2 (see above for why not L1).
[[gnu::always_inline]] inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// A read of the cache line at p marked non-temporal (prefetchnta on x86): for bytes read once per
// step, the weights of a decode GEMV and the bandwidth probe that stands for it, a line or two
// ahead of the loads. The lines still come through L1 and L2 as the loads need them, but the
// caches let them go first and do not keep them as victims in the L3: streamed as ordinary loads,
// a step's 256 MB (bfloat16) passed through the L3 and pushed out everything else, the KV cache,
// the attention's and the norms' buffers and the Python engine's own state, which the step then
// read back from memory. AMD EPYC Zen 4, 2 threads, the default model at batch 1, alternating
// processes, medians of 3 x 6 runs: bfloat16 6.77 -> 6.32 ms a token, float32 11.1 -> 10.6
// (AVX2 forced: bfloat16 7.15 -> 6.47, float32 11.1 -> 10.7); the Python part of a step 0.30 ->
// 0.13-0.19 ms; a plain 256 MB stream 9.0-9.6 -> 7.9-8.8 ms. Steps further ahead (2, 4, 16)
// gained less or lost.
[[gnu::always_inline]] inline void prefetch_nta(const void* p) { __builtin_prefetch(p, 0, 0); }

struct Prefetch {
  const char* base = nullptr;
  int64_t first = 0, count = 0;  // cache lines [first, first + count) from base

  static Prefetch bytes(const void* at, int64_t n) { return {static_cast<const char*>(at), 0, n / 64}; }
  // The t-th of `parts` equal slices: one a row tile.
  Prefetch slice(int64_t t, int64_t parts) const {
    const int64_t l0 = first + t * count / parts, l1 = first + (t + 1) * count / parts;
    return {base, l0, l1 - l0};
  }
  void line(int64_t i) const { prefetch_l2(base + 64 * i); }
  void issue() const {
    for (int64_t i = first; i < first + count; ++i) line(i);
  }
};

// Cache lines queued for prefetch and issued a few at a time from a kernel's inner loops, so
// that the fetches overlap its arithmetic: a burst of a whole tile's prefetches fills the load
// queue and stalls the core until the lines arrive.
class LineQueue {
 public:
  // `rows` runs of `lines` cache lines each, the runs `stride` bytes apart, from p
  void push(const void* p, int64_t stride, int64_t lines, int64_t rows) {
    if (lines <= 0 || rows <= 0) return;
    if (n_ == kMax) drain();
    runs_[n_++] = {static_cast<const char*>(p), stride, lines, rows, 0, 0};
  }
  // the next k queued lines (fewer where fewer are left), oldest run first, to fetch(line)
  template <typename Fetch>
  [[gnu::always_inline]] void issue(int k, Fetch&& fetch) {
    for (; k > 0 && head_ < n_; --k) {
      Run& r = runs_[head_];
      fetch(r.p + r.row * r.stride + r.line * 64);
      if (++r.line == r.lines) {
        r.line = 0;
        if (++r.row == r.rows) ++head_;
      }
    }
    if (head_ == n_) head_ = n_ = 0;
  }
  [[gnu::always_inline]] void issue(int k) {
    issue(k, [](const char* line) { prefetch_l2(line); });
  }
  // every queued line at once (also when a ninth run is pushed)
  void drain() {
    for (; head_ < n_; ++head_) {
      const Run& r = runs_[head_];
      for (int64_t row = r.row, line = r.line; row < r.rows; ++row, line = 0)
        for (const char* p = r.p + row * r.stride; line < r.lines; ++line) prefetch_l2(p + line * 64);
    }
    head_ = n_ = 0;
  }
  void clear() { head_ = n_ = 0; }

 private:
  struct Run {
    const char* p;
    int64_t stride, lines, rows, row, line;
  };
  static constexpr int kMax = 8;
  Run runs_[kMax];
  int n_ = 0, head_ = 0;
};

}  // namespace
}  // namespace cpuserve
