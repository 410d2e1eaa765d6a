// reshape_and_cache: writes this step's keys and values into their cache slots.
// Value cache [num_blocks, num_kv_heads, block_size, head_dim]; key cache transposed in each
// block, [num_blocks, num_kv_heads, head_dim, block_size] (as vLLM's CPU backend keeps keys
// head_dim-major): attention's scores are then vector FMAs over a block's keys, one chain
// over head_dim per key, with no horizontal sums. One (block, head) is a contiguous tile.
//
// A bfloat16 cache keeps its tiles in pairs (kPairedCache): a key tile as [d / 2][bs][2] (the
// dimensions e, e + 1 of each key side by side), a value tile as [bs / 2][d][2] (the values of keys
// j, j + 1 side by side): the operands of vdpbf16ps and of AMX's tdpbf16ps as they are, so that
// attention reads its tiles without pairing them first (head_dim and block_size even). The
// shapes stay those above; only the order inside a tile differs (ops_ref.py writes it out).
#pragma once
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#include "../vec/vec.hpp"

namespace cpuserve {
namespace {

template <typename T> constexpr bool kPairedCache = std::is_same_v<T, bf16>;

// Where key dimension e of a tile's key j sits in its key tile, and value e of key j in its value tile.
template <typename T>
inline int64_t key_at(int64_t e, int64_t j, int64_t bs) {
  if constexpr (kPairedCache<T>) return (e >> 1) * 2 * bs + 2 * j + (e & 1);
  return e * bs + j;
}
template <typename T>
inline int64_t value_at(int64_t j, int64_t e, int64_t d) {
  if constexpr (kPairedCache<T>) return (j >> 1) * 2 * d + 2 * e + (j & 1);
  return j * d + e;
}

// dst = src * inv_scale in the cache's dtype (inv_scale: 1 / the float8 cache's scale, else 1).
template <typename T>
inline void convert_row(T* dst, const float* src, int64_t n, float inv_scale) {
  int64_t i = 0;
  if (inv_scale == 1.f) {
    for (; i + VecF::N <= n; i += VecF::N) VecF::load(src + i).store(dst + i);
    for (; i < n; ++i) dst[i] = from_float<T>(src[i]);
    return;
  }
  const VecF sv = VecF::set1(inv_scale);
  for (; i + VecF::N <= n; i += VecF::N) (VecF::load(src + i) * sv).store(dst + i);
  for (; i < n; ++i) dst[i] = from_float<T>(src[i] * inv_scale);
}

// Runs of at most kRun tokens whose slots follow one another in one block: [first token, count).
// A prompt's tokens are runs of kRun (a float32 cache line of a key dimension; enough runs to
// share among the threads), a decode step's one token per sequence.
constexpr int64_t kRun = 16;

inline const std::vector<std::pair<int64_t, int64_t>>& slot_runs(const int64_t* slot_mapping, int64_t tokens,
                                                                 int64_t block_size) {
  thread_local std::vector<std::pair<int64_t, int64_t>> runs;
  runs.clear();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    if (!runs.empty()) {
      auto& [t0, n] = runs.back();
      if (n < kRun && t0 + n == t && slot_mapping[t0] + n == slot && slot % block_size != 0) {
        ++n;
        continue;
      }
    }
    runs.emplace_back(t, 1);
  }
  return runs;
}

// The widest head a run's rows are staged for on the stack (cache_keys, cache_values); wider heads
// take the element loops.
constexpr int64_t kStagedD = 256;

// Keys of n tokens into their transposed block tile kt from column off: along each row of the
// tile (one key dimension, or a pair of them) the n tokens are consecutive, so every cache line
// written is written whole, one after the other (a token at a time wrote one float in each of
// head_dim lines). The run's keys are converted a row at a time as vectors first, then each row
// of the tile gathers its n elements (or pairs) from them. A 2,048-token prompt's bfloat16 keys and
// values over 30 layers (SmolLM2, the Xeon with AMX, two threads, old and new in one binary taking
// turns, medians of 11-21 rounds in minutes of different speeds): 22.9 -> 18.3 ms, 22.9 -> 20.9,
// 13.2 -> 12.1 (one thread 26.9 -> 25.5); float32 0.97x. What is left is mostly the cache's lines
// written from memory. A prefill's tokens come in runs of up to kRun.
template <typename T>
inline void cache_keys(T* kt, int64_t off, const float* key, int64_t key_stride, int64_t n, int64_t d,
                       int64_t block_size, float k_inv) {
  if (n > kRun || d > kStagedD) {
    for (int64_t e = 0; e < d; ++e)
      for (int64_t i = 0; i < n; ++i) {
        const float x = key[i * key_stride + e];
        kt[key_at<T>(e, off + i, block_size)] = from_float<T>(k_inv == 1.f ? x : x * k_inv);
      }
    return;
  }
  alignas(64) T rows[kRun][kStagedD];
  for (int64_t i = 0; i < n; ++i) convert_row(rows[i], key + i * key_stride, d, k_inv);
  if constexpr (kPairedCache<T>) {  // a tile row: the pairs (e, e + 1) of keys off.. side by side
    for (int64_t e = 0; e < d; e += 2) {
      T* out = kt + key_at<T>(e, off, block_size);
      for (int64_t i = 0; i < n; ++i) std::memcpy(out + 2 * i, &rows[i][e], 2 * sizeof(T));
    }
  } else {
    for (int64_t e = 0; e < d; ++e) {
      T* out = kt + key_at<T>(e, off, block_size);
      for (int64_t i = 0; i < n; ++i) out[i] = rows[i][e];
    }
  }
}

// Values of one token into row j of its value tile vt.
template <typename T>
inline void cache_value(T* vt, int64_t j, const float* value, int64_t d, float v_inv) {
  if constexpr (!kPairedCache<T>) return convert_row(vt + j * d, value, d, v_inv);
  constexpr int64_t kMaxD = 512;
  T row[kMaxD];
  for (int64_t e0 = 0; e0 < d; e0 += kMaxD) {
    const int64_t n = std::min(kMaxD, d - e0);
    convert_row(row, value + e0, n, v_inv);
    for (int64_t e = 0; e < n; ++e) vt[value_at<T>(j, e0 + e, d)] = row[e];
  }
}

// Values of n tokens into rows off.. of their value tile vt. A paired tile's row of pairs holds two
// tokens' values side by side: two tokens converted, then interleaved into it in one pass (a
// token at a time wrote every other element of it); a token without its partner in the run
// (an odd first or last slot) writes its half alone.
template <typename T>
inline void cache_values(T* vt, int64_t off, const float* value, int64_t value_stride, int64_t n, int64_t d,
                         float v_inv) {
  int64_t i = 0;
  if constexpr (kPairedCache<T>) {
    if (d <= kStagedD) {
      if (off % 2 && n > 0) cache_value(vt, off, value, d, v_inv), i = 1;
      alignas(64) T a[kStagedD], b[kStagedD];
      for (; i + 1 < n; i += 2) {
        convert_row(a, value + i * value_stride, d, v_inv);
        convert_row(b, value + (i + 1) * value_stride, d, v_inv);
        T* out = vt + value_at<T>(off + i, 0, d);
        for (int64_t e = 0; e < d; ++e) {
          out[2 * e] = a[e];
          out[2 * e + 1] = b[e];
        }
      }
    }
  }
  for (; i < n; ++i) cache_value(vt, off + i, value + i * value_stride, d, v_inv);
}

// The cache lines an item (a run of tokens, one head) writes, fetched for writing while the item
// before it runs: a decode token's key is one value in each of head_dim lines of a tile the last
// attention may have left in memory, each written line otherwise a miss of its own in turn (64
// sequences of bfloat16 cache, AMD EPYC Zen 5: 75 -> 59 us a layer). Two, four or eight items ahead
// instead of one (AMD EPYC Zen 4, 30 layers' caches from memory, 15 rounds taking turns): 16 tokens
// float32 0.94-0.97x the time, bfloat16 0.91-0.93x, 64 tokens 0.97-1.00x: 30-80 us of a 16-row
// decode step's 19-36 ms, not taken.
template <typename T>
inline void prefetch_item(std::pair<int64_t, int64_t> run, int64_t h, const T* k_cache, const T* v_cache,
                          const int64_t* slot_mapping, int64_t heads, int64_t d, int64_t block_size) {
  const int64_t slot = slot_mapping[run.first];
  const int64_t tile = slot / block_size * heads + h, off = slot % block_size;
  const T* kt = k_cache + tile * d * block_size;
  for (int64_t e = 0; e < d; e += kPairedCache<T> ? 2 : 1) __builtin_prefetch(kt + key_at<T>(e, off, block_size), 1, 3);
  const char* v = reinterpret_cast<const char*>(v_cache + tile * block_size * d + value_at<T>(off, 0, d));
  const int64_t bytes = (run.second + (kPairedCache<T> ? 1 : 0)) * d * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(v + b, 1, 3);
}

template <typename T>
void reshape_and_cache_t(const float* key, const float* value, T* k_cache, T* v_cache,
                         const int64_t* slot_mapping, int64_t tokens, int64_t heads, int64_t d,
                         int64_t block_size, int64_t key_stride, int64_t value_stride, float k_inv, float v_inv) {
  const auto& runs = slot_runs(slot_mapping, tokens, block_size);
  const int64_t items = static_cast<int64_t>(runs.size()) * heads;
#pragma omp parallel for schedule(static) if (tokens > 8)
  for (int64_t it = 0; it < items; ++it) {
    const auto [t0, n] = runs[it / heads];
    const int64_t h = it % heads, slot = slot_mapping[t0];
    const int64_t block = slot / block_size, off = slot % block_size, tile = block * heads + h;
    if (it + 1 < items) prefetch_item(runs[(it + 1) / heads], (it + 1) % heads, k_cache, v_cache, slot_mapping,
                                      heads, d, block_size);
    cache_values(v_cache + tile * block_size * d, off, value + t0 * value_stride + h * d, value_stride, n, d, v_inv);
    cache_keys(k_cache + tile * d * block_size, off, key + t0 * key_stride + h * d, key_stride, n, d, block_size,
               k_inv);
  }
}

void reshape_and_cache_impl(const float* key, const float* value, void* k_cache, void* v_cache,
                            DType dt, const int64_t* slot_mapping, int64_t tokens, int64_t heads,
                            int64_t d, int64_t block_size, int64_t key_stride, int64_t value_stride,
                            float k_scale, float v_scale) {
  with_cache_type(dt, [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    reshape_and_cache_t(key, value, static_cast<T*>(k_cache), static_cast<T*>(v_cache), slot_mapping, tokens,
                        heads, d, block_size, key_stride, value_stride, 1.f / k_scale, 1.f / v_scale);
  });
}

}  // namespace
}  // namespace cpuserve
