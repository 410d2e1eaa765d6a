// Software prefetch of the weight bytes a batched GEMM multiplies next. A batch GEMM reuses
// each weight chunk across its row tiles, so it is compute-bound on average, but the first row
// tile over a chunk found it in DRAM and waited: the hardware prefetchers follow that tile's
// reads too closely to hide the latency. Fetching the next chunk into L2 while this one's row
// tiles run hides it (decode, where each byte is used once, fetches a few lines ahead of its loads:
// DecodeFetch).
// The paged attention fetches some items' next cache block the same way (attention.hpp,
// fetches_ahead), an address no hardware prefetcher can guess.
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

// How a decode GEMV (one or two rows, each weight byte used once) and the bandwidth probe that
// stands for it ask for the weight lines ahead of their loads: a process-wide choice made for the
// CPU's vendor (decode_fetch_for, dispatch.cpp), CPUSERVE_DECODE_FETCH overriding it.
// - kNonTemporal: the next k step's lines, non-temporal (prefetch_nta below): AMD, and every CPU
//   not measured otherwise.
// - kL2Ahead: the lines kL2AheadSteps k steps on, into L2, and the probe's loads left to the
//   hardware prefetchers: Intel. On Intel's server cores prefetchnta fills L1 and skips the L2, so
//   the L2's streamers never see the stream and every line waits on memory: on the Xeon with AMX
//   (family 6 model 207, 2 threads, the default model's 120 float32 layer GEMVs from memory, 425
//   MB, variants taking turns in one binary, medians of 21-31 rounds) non-temporal lines one step
//   ahead took 1.21-1.33x the time of no software fetch at all, lines into L2 one step ahead
//   1.06x, four 0.91x, eight 0.86-0.94x, sixteen 0.88-0.98x; the probe's plain loads read 24.3
//   GB/s where its non-temporal ones read 16.5.
enum class DecodeFetch : int { kNonTemporal = 0, kL2Ahead = 1 };
constexpr int64_t kL2AheadSteps = 8;  // k steps: 1 KB of each float32 panel
DecodeFetch decode_fetch();
void set_decode_fetch(DecodeFetch f);
// The choice for a CPU vendor's CPUID string ("GenuineIntel", "AuthenticAMD"; "" off x86).
DecodeFetch decode_fetch_for(const char* vendor);

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

// The first line of each 4 KiB page of the n elements at p, fetched into L2: bytes read soon as a
// run of pages (a whole-sequence decode item's next tiles, attention.hpp whole_sequences), so that
// the pages' translations and the hardware's streams over them start before the loads get there;
// the lines between are left to those streams.
template <typename T>
inline void fetch_pages(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t o = 0; o < n * static_cast<int64_t>(sizeof(T)); o += 4096) prefetch_l2(c + o);
}

// The lines of the n floats at p, asked for to be written (a tile of a GEMM's output before its
// dot products, so that its stores at their end do not miss: int8.hpp; gemm.hpp's micro-kernel
// has the same loop written in itself, see kFetchTileOfC there).
inline void fetch_for_write(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 1, 3);
  __builtin_prefetch(p + n - 1, 1, 3);
}

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

}  // namespace
}  // namespace cpuserve
