// Paged attention for mixed batches: every sequence brings q_len query tokens
// (a prefill chunk, or 1 for decode) that are the last q_len positions of its
// context; keys and values come from the paged cache through its block table.
//
// Work item = (sequence, kv head, tile of up to kQTile query rows). The item walks
// the sequence's blocks in order; all query heads of the kv group and all rows of
// the tile share each loaded key/value tile. Each (row, head) keeps an online
// softmax (running max m, sum l, accumulator acc[D]) updated block by block (on
// AMX tiles a step of several blocks, counted from each partition's start), so
// a row's result depends only on its position and its context: not on the tile,
// the chunking of the prefill, the batch or the thread count.
//
// A row's keys run in partitions of kPartitionKeys (whole blocks, counted from key 0): each
// partition's online softmax starts afresh and is merged into the row's total in order
// (merge_state), the way flash-decoding splits a long context. An item walking all of a row's
// blocks merges at each partition's end; a decode row is split into one item a partition where
// the threads finish sooner that way (attention_items), sharing its context, and its partitions
// merged after them in the same order with the same arithmetic: the same bits either way.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#include <omp.h>
#include "../vec/vec.hpp"
#include "amx.hpp"
#include "block_softmax.hpp"
#include "cache.hpp"
#include "line_vector.hpp"
#include "prefetch.hpp"
#include "shares.hpp"

namespace cpuserve {
namespace {

constexpr int64_t kQTile = 16;
#ifdef __AVX512BF16__
constexpr bool kBf16PairAttention = true;
#else
constexpr bool kBf16PairAttention = false;
#endif
#ifdef __AMX_BF16__
constexpr bool kAmxAttention = true;
#else
constexpr bool kAmxAttention = false;
#endif
constexpr int64_t kAmxKeys = 32;         // keys an AMX values step takes (16 pairs)
constexpr int64_t kAmxStepBlocks = 16;  // blocks an online softmax step on AMX tiles takes at most

// How a call computes its blocks: float tiles widened in registers (direct), widened into float
// buffers first (widen: float8 or scaled caches), bfloat16 pair dot products (pairs), or AMX tiles
// (amx). Every row of a call takes the same path, and so does every call with the same cache
// dtype, scales, head size and block size: a row's bits never depend on its batch.
enum class AttnPath { widen, direct, pairs, amx };

// Rows [row0, row0 + rows) of one sequence, query heads [g0, g1) of kv head kv_head's group.
// A decode row may take its sequence's nkv kv heads (from kv_head on) in one item: see whole_sequences.
// part >= 0: only the blocks of that partition (see kPartitionKeys), the item's softmax state
// left in partial slot `slot` for merge_partitions.
struct AttnItem { int32_t seq, kv_head, row0, rows, g0, g1, nkv = 1, part = -1, slot = -1; };

// The keys of a partition: each runs its own online softmax, merged in order into the row's total.
// A single sequence's 3 kv heads at 7,500 tokens are 12 items for the threads where they were 3
// (two threads: 2 and 1). vLLM's paged attention v2 takes 512; here a 2,048-token prefill's rows
// would then merge up to three times: its attention took 1.03-1.05x the time (AMD EPYC Zen 4, float32,
// the builds taking turns), where 2,048 leaves it level (rows up to 2,048 keys never merge) and
// still takes one sequence's decode at 7,500 tokens to 0.73-0.80x (512: 0.63-0.69x), at 3,000 to
// 0.75-0.79x (512: 0.65x).
constexpr int64_t kPartitionKeys = 2048;
inline int64_t partition_blocks(int64_t bs) { return std::max<int64_t>(1, kPartitionKeys / bs); }

// dst = src * scale (scale: the float8 cache's per-tensor scale, 1 otherwise).
template <typename T>
inline void convert_to_float(float* dst, const T* src, int64_t n, float scale) {
  int64_t i = 0;
  if (scale == 1.f) {
    for (; i + VecF::N <= n; i += VecF::N) VecF::load(src + i).store(dst + i);
    for (; i < n; ++i) dst[i] = to_float(src[i]);
    return;
  }
  const VecF sv = VecF::set1(scale);
  for (; i + VecF::N <= n; i += VecF::N) (VecF::load(src + i) * sv).store(dst + i);
  for (; i < n; ++i) dst[i] = to_float(src[i]) * scale;
}

// Micro-kernel blocking, sized to the ISA's vector registers: scores of QB query vectors x KB
// key vectors, value accumulators of R rows x V vectors. With 16 registers (AVX2) 6 x 2 for both,
// 12 accumulators and 15 registers, where 4 x 2 scores and 2 x 4 values kept 8 chains, just what
// two FMA pipes of 4 cycles' latency need with nothing to spare: a prefill's attention a layer,
// the AVX2 table on AMD EPYC Zen 4, two threads, old and new in one process taking turns (medians
// of 3-5): 2,048 tokens 0.89-0.90x the time in float32 and bfloat16, 512 tokens 0.93-0.95x, 16
// prompts of 128 float32 0.96x, bfloat16 1.01-1.03x (0.98-1.09 across rounds). 3 x 4 values (12
// accumulators, 17 registers) took bfloat16 1.19-1.27x the time: its widened values cannot be
// read from memory by the FMAs.
constexpr int kScoreQB = 6;
constexpr int kScoreKB = VecF::kRegs >= 32 ? 4 : 2;
// Decode (a block of few rows, few_rows) blocks the scores as kDecodeQB x kDecodeKB instead: with
// 32 vector registers, 8 key vectors are a float32 block's whole row of 128 keys, so the
// transposed key tile is read row after row, one sequential stream that the hardware prefetchers
// follow, where 4 took every other half row (a 512-byte stride). AMD EPYC
// Zen 4, two threads, 200 tokens of context, 30 layers' caches from memory, the builds taking
// turns: float32 16 sequences 350-403 -> 269-272 us a layer, 64 sequences 1,375-1,399 -> 966-977;
// bfloat16 16 sequences 215-230 -> 191-210. Prefill keeps 6 x 4 (3 x 8 made a 2,048-token
// prefill's attention 8% slower in float32, 21% in bfloat16). The same chains: the same bits.
// With 16 registers (AVX2) the scores take 3 x 4 (12 accumulators; the compiler reads one key
// vector from memory: a group of 4 takes 3 + 1), a quarter of a float32 block's key row a pass,
// each pass fetching the next one's lines (scores_blocked); the values take one row at a time
// over 8 vectors, a value row of SmolLM2's 64 elements whole (kDecodeValueR, kDecodeValueV), where
// 2 rows x 4 vectors read half rows, rows 0-1 and then row 2 each in two passes, and the 4 x 2
// scores an eighth of a key row a pass. AVX2's decode attention had run at 1.7x AVX-512's time on
// the same FMA units, its loads waiting on lines the prefetchers did not bring. The AVX2 table on
// AMD EPYC Zen 4, two threads, 30 layers' caches from memory, old and new in one process taking
// turns (medians of 9): float32 64 sequences of 136 / 200 tokens 0.73x / 0.76x the time, 16 of 200
// 0.80x, one of 1,000 0.63x; bfloat16 64 of 136 0.91x, 16 of 200 0.88x. In `cpuserve bench` with
// CPUSERVE_ISA=avx2, the builds taking turns by process: the 64-row float32 step's attention 19.5-
// 20.8 -> 15.7-16.4 ms, the step 92.6-94.1 -> 89.8-90.7 ms; bfloat16's attention 12.9-15.3 ->
// 10.6-12.3. The tables with 32 registers keep their blocking (AVX-512 reads whole rows already).
constexpr int kDecodeQB = 3;
constexpr int kDecodeKB = VecF::kRegs >= 32 ? 8 : 4;
constexpr int kValueR = 6;
constexpr int kValueV = VecF::kRegs >= 32 ? 4 : 2;
constexpr int kDecodeValueR = VecF::kRegs >= 32 ? kValueR : 1;
constexpr int kDecodeValueV = VecF::kRegs >= 32 ? kValueV : 8;

// Where the micro-kernels read a block's keys (row e, column j) or values (row j, column e):
// Rows<T> widens T in registers (bf16x2: pairs already laid out), HalfRows widens one row of a
// paired bfloat16 tile (kernels/cache.hpp), MaskedPairs reads a paired value tile's pairs with the
// keys outside a range zeroed.
template <typename T> struct Rows {
  using Elem = T;
  const T* p;
  int64_t stride;
  static constexpr int64_t kRowStep = 1, kVecBytes = VecF::N * static_cast<int64_t>(sizeof(T));
  [[gnu::always_inline]] VecF at(int64_t row, int64_t col) const { return VecF::load(p + row * stride + col); }
  float elem(int64_t row, int64_t col) const { return to_float(p[row * stride + col]); }
  const void* address(int64_t row, int64_t col) const { return p + row * stride + col; }
};
// The rows of a paired bfloat16 tile (kernels/cache.hpp: rows 2r and 2r + 1 interleaved in pair row
// r, `stride` pairs long) from row row0 on, each widened to float32 in registers.
struct HalfRows {
  using Elem = bf16;
  const bf16x2* p;
  int64_t stride, row0;
  static constexpr int64_t kRowStep = 2, kVecBytes = VecF::N * static_cast<int64_t>(sizeof(bf16x2));
  const void* address(int64_t row, int64_t col) const { return p + ((row0 + row) >> 1) * stride + col; }
  [[gnu::always_inline]] VecF at(int64_t row, int64_t col) const {
    const int64_t r = row0 + row;
    return VecF::widen_half(p + (r >> 1) * stride + col, static_cast<int>(r & 1));
  }
  float elem(int64_t row, int64_t col) const {
    const int64_t r = row0 + row;
    return to_float(reinterpret_cast<const bf16*>(p)[((r >> 1) * stride + col) * 2 + (r & 1)]);
  }
};
inline const bf16x2* pairs_of(const bf16* p) { return reinterpret_cast<const bf16x2*>(p); }

// A block's key tile (rows e, columns j) and its value rows from key j0 on (rows j, columns e).
template <typename T> struct TileRows {
  static Rows<T> keys(const T* kt, int64_t bs) { return {kt, bs}; }
  static Rows<T> values(const T* vt, int64_t d, int64_t j0) { return {vt + j0 * d, d}; }
};
template <> struct TileRows<bf16> {
  static HalfRows keys(const bf16* kt, int64_t bs) { return {pairs_of(kt), bs, 0}; }
  static HalfRows values(const bf16* vt, int64_t d, int64_t j0) { return {pairs_of(vt), d, j0}; }
};
#ifdef __AVX512BF16__
// Pair rows of a paired bfloat16 value tile, `stride` pairs long, a key outside [lo, hi] reading as
// zero (its probability is zero for every row; the slot may hold another sequence's stale bits).
struct MaskedPairs {
  using Elem = bf16x2;
  const bf16x2* p;
  int64_t stride, lo, hi;
  [[gnu::always_inline]] VecF at(int64_t row, int64_t col) const {
    const VecF x = VecF::load(p + row * stride + col);
    const int64_t r = 2 * row;
    if (r >= lo && r + 1 <= hi) return x;
    const int keep = (r >= lo && r <= hi ? 0xffff : 0) | (r + 1 >= lo && r + 1 <= hi ? -65536 : 0);
    return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x.v), _mm512_set1_epi32(keep)))};
  }
};
#endif

// Scores of query vectors qs[0, QB) against key vectors [c, c + KB) of a block whose keys are
// stored transposed: each score is one FMA chain over e = 0..d-1 from zero, so its bits do not
// depend on the blocking, the tile or the path (decode or prefill). With bf16x2 elements the
// keys are pairs (e, e + 1), the queries bfloat16 pairs and d counts pairs: one vdpbf16ps chain.
template <typename Src, int QB, int KB>
inline void scores_micro(const AOf<typename Src::Elem>* const* qs, const Src& kt, int64_t bs, int64_t d, int64_t c,
                         float* s) {
  VecF acc[QB][KB];
  for (int i = 0; i < QB; ++i)
    for (int j = 0; j < KB; ++j) acc[i][j] = VecF::zero();
  for (int64_t e = 0; e < d; ++e) {
    VecF k[KB];
    for (int j = 0; j < KB; ++j) k[j] = kt.at(e, (c + j) * VecF::N);
    for (int i = 0; i < QB; ++i) {
      const VecF qe = VecF::set1(qs[i][e]);
      for (int j = 0; j < KB; ++j) acc[i][j] = Madd<typename Src::Elem>::apply(qe, k[j], acc[i][j]);
    }
  }
  for (int i = 0; i < QB; ++i)
    for (int j = 0; j < KB; ++j) acc[i][j].store(s + i * bs + (c + j) * VecF::N);
}

// scores_micro for qb <= QB query vectors and kb <= KB key vectors.
template <typename Src, int QB, int KB>
inline void scores_tile(int qb, int kb, const AOf<typename Src::Elem>* const* qs, const Src& kt, int64_t bs, int64_t d,
                        int64_t c, float* s) {
  if constexpr (QB > 1) {
    if (qb < QB) return scores_tile<Src, QB - 1, KB>(qb, kb, qs, kt, bs, d, c, s);
  }
  if constexpr (KB > 1) {
    if (kb < KB) return scores_tile<Src, QB, KB - 1>(qb, kb, qs, kt, bs, d, c, s);
  }
  scores_micro<Src, QB, KB>(qs, kt, bs, d, c, s);
}

// Fetches into L2 the lines of key vectors [c, c + kb) in every row e < d of a key tile.
template <typename Src>
inline void fetch_key_vectors(const Src& kt, int64_t d, int64_t c, int64_t kb) {
  for (int64_t e = 0; e < d; e += Src::kRowStep) {
    const char* row = static_cast<const char*>(kt.address(e, c * VecF::N));
    for (int64_t b = 0; b < kb * Src::kVecBytes; b += 64) prefetch_l2(row + b);
  }
}

// block_scores in QB x KB micro-kernels. A decode's pass over part of each row (KB vectors short of
// the block's keys: AVX2's quarter rows, NEON's and VXE's) fetches the next pass's lines first
// (FetchNext): its loads, two lines a row 512 bytes apart, are a pattern the hardware prefetchers
// did not follow, and without the fetch they waited on every line (AVX2 table, AMD EPYC Zen 4:
// decode attention 0.85-0.93x the time with it; the first pass of a tile, or the whole tile,
// fetched at once gained nothing, 0.99-1.05x, nor did the next head's first pass fetched during
// this head's last, 0.93-1.01x). Measured on x86 only; the fetch changes no bits.
template <typename Src, int QB, int KB, bool FetchNext = false>
inline void scores_blocked(const AOf<typename Src::Elem>* const* qs, int64_t nq, const Src& kt, int64_t bs, int64_t d,
                           int64_t c_lo, int64_t c_hi, float* s) {
  // key vectors outer: their d x KB slab stays in L1 while every query vector passes over it
  for (int64_t c = c_lo; c <= c_hi; c += KB) {
    const int kb = static_cast<int>(std::min<int64_t>(KB, c_hi - c + 1));
    if constexpr (FetchNext) {
      if (c + KB <= c_hi) fetch_key_vectors(kt, d, c + KB, std::min<int64_t>(KB, c_hi - c - KB + 1));
    }
    for (int64_t i = 0; i < nq; i += QB) {
      const int qb = static_cast<int>(std::min<int64_t>(QB, nq - i));
      scores_tile<Src, QB, KB>(qb, kb, qs + i, kt, bs, d, c, s + i * bs);
    }
  }
}

// Whether a block of this many (row, head) pairs is a decode's few, one micro-kernel's worth: bound
// by its reads of the cache, where more rows are bound by their arithmetic.
inline bool few_rows(int64_t n_rows) { return n_rows <= kScoreQB; }

// s[i * bs + j] = q_i . k_j for the nq query vectors and the key vectors [c_lo, c_hi] of a block;
// a decode's few rows in decode's blocking.
template <typename Src>
inline void block_scores(const AOf<typename Src::Elem>* const* qs, int64_t nq, const Src& kt, int64_t bs, int64_t d,
                         int64_t c_lo, int64_t c_hi, float* s) {
  if (few_rows(nq)) return scores_blocked<Src, kDecodeQB, kDecodeKB, true>(qs, nq, kt, bs, d, c_lo, c_hi, s);
  scores_blocked<Src, kScoreQB, kScoreKB>(qs, nq, kt, bs, d, c_lo, c_hi, s);
}

// acc_i[e0, e0 + V * N) += sum_j p_i[j] * v[j, e0:] for R rows (accumulators acc + i * d,
// probabilities p + i * ps): one FMA chain per element in key order, every value vector loaded
// (and widened) once for the R rows. With bf16x2 elements, j counts pairs of keys (j, j + 1): v
// gives their values' pairs, p holds the probabilities' bfloat16 pairs, one vdpbf16ps chain.
template <typename Src, int R, int V>
inline void values_micro(float* acc, const AOf<typename Src::Elem>* p, int64_t ps, const Src& v, int64_t n, int64_t d,
                         int64_t e0) {
  VecF r[R][V];
  for (int i = 0; i < R; ++i)
    for (int k = 0; k < V; ++k) r[i][k] = VecF::load(acc + i * d + e0 + k * VecF::N);
  for (int64_t j = 0; j < n; ++j) {
    VecF x[V];
    for (int k = 0; k < V; ++k) x[k] = v.at(j, e0 + k * VecF::N);
    for (int i = 0; i < R; ++i) {
      const VecF pj = VecF::set1(p[i * ps + j]);
      for (int k = 0; k < V; ++k) r[i][k] = Madd<typename Src::Elem>::apply(pj, x[k], r[i][k]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int k = 0; k < V; ++k) r[i][k].store(acc + i * d + e0 + k * VecF::N);
}

template <typename Src, int R, int V>
inline void values_tile(int rr, int vv, float* acc, const AOf<typename Src::Elem>* p, int64_t ps, const Src& v,
                        int64_t n, int64_t d, int64_t e0) {
  if constexpr (R > 1) {
    if (rr < R) return values_tile<Src, R - 1, V>(rr, vv, acc, p, ps, v, n, d, e0);
  }
  if constexpr (V > 1) {
    if (vv < V) return values_tile<Src, R, V - 1>(rr, vv, acc, p, ps, v, n, d, e0);
  }
  values_micro<Src, R, V>(acc, p, ps, v, n, d, e0);
}

// The vector part of accumulate_values in R x V tiles.
template <typename Src, int R, int V>
inline void values_blocked(float* acc, const AOf<typename Src::Elem>* p, int64_t ps, int64_t rows, const Src& v,
                           int64_t n, int64_t d) {
  const int64_t nvec = d / VecF::N;
  for (int64_t i = 0; i < rows; i += R)
    for (int64_t c = 0; c < nvec; c += V) {
      const int rr = static_cast<int>(std::min<int64_t>(R, rows - i));
      const int vv = static_cast<int>(std::min<int64_t>(V, nvec - c));
      values_tile<Src, R, V>(rr, vv, acc + i * d, p + i * ps, ps, v, n, d, c * VecF::N);
    }
}

// acc_i[0:d] += sum_j p_i[j] * v[j, 0:d] for the rows i < rows (acc + i * d, p + i * ps) over
// the n keys of v: the same chains whatever the number of rows taken together, a decode's few in
// decode's blocking.
template <typename Src>
inline void accumulate_values(float* acc, const AOf<typename Src::Elem>* p, int64_t ps, int64_t rows, const Src& v,
                              int64_t n, int64_t d) {
  const int64_t nvec = d / VecF::N;
  if (few_rows(rows)) {
    values_blocked<Src, kDecodeValueR, kDecodeValueV>(acc, p, ps, rows, v, n, d);
  } else {
    values_blocked<Src, kValueR, kValueV>(acc, p, ps, rows, v, n, d);
  }
  if constexpr (!std::is_same_v<typename Src::Elem, bf16x2>) {  // (the pair path runs only when N divides d)
    for (int64_t e = nvec * VecF::N; e < d; ++e)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < n; ++j)
          acc[i * d + e] = std::fma(p[i * ps + j], v.elem(j, e), acc[i * d + e]);
  }
}

// online_softmax in its three passes.
// The max of the block's scores p[0, n), scaled; `fold` becomes the factor the exp pass applies.
[[gnu::always_inline]] inline float softmax_block_max(float* p, int64_t n, float scale, float softcap, float& fold) {
  float blk_max = -std::numeric_limits<float>::infinity();
  fold = 1.f;  // the scale, where not applied here
  int64_t j = 0;
  if (softcap > 0.f) {
    for (; j < n; ++j) {
      p[j] = softcap * std::tanh(p[j] * scale / softcap);
      blk_max = std::max(blk_max, p[j]);
    }
  } else if (scale > 0.f) {
    // the raw scores' max: a positive factor keeps their order, and max(s) * scale rounds to
    // max(s * scale); the exp pass scales each score in its fused multiply-add
    VecF vm = VecF::set1(blk_max);
    for (; j + VecF::N <= n; j += VecF::N) vm = VecF::max(vm, VecF::load(p + j));
    blk_max = vm.reduce_max();
    for (; j < n; ++j) blk_max = std::max(blk_max, p[j]);
    blk_max *= scale;
    fold = scale;
  } else {
    for (; j < n; ++j) {
      p[j] = p[j] * scale;
      blk_max = std::max(blk_max, p[j]);
    }
  }
  return blk_max;
}

// p[0, n) -> exp(fma(p, fold, -m_new)), in place; returns their sum.
[[gnu::always_inline]] inline float softmax_block_exp(float* p, int64_t n, float fold, float m_new) {
  const VecF vf = VecF::set1(fold), vneg = VecF::set1(-m_new);
  VecF vsum = VecF::zero();
  int64_t j = 0;
  for (; j + VecF::N <= n; j += VecF::N) {
    const VecF e = VecF::fma(VecF::load(p + j), vf, vneg).exp();
    e.store(p + j);
    vsum = vsum + e;
  }
  float psum = vsum.reduce_sum();
  for (; j < n; ++j) {
    p[j] = std::exp(std::fma(p[j], fold, -m_new));
    psum += p[j];
  }
  return psum;
}

// The running max *m and sum *l moved on to m_new (the block's exp sum psum), the accumulator
// acc[0, d) rescaled where the max moved. exp(-inf) = 0 on the first block; a max that did not
// move leaves the sum and accumulator.
[[gnu::always_inline]] inline void softmax_block_fold(float m_new, float psum, float* m, float* l, float* acc,
                                                      int64_t d) {
  const float alpha = m_new == *m ? 1.f : std::exp(*m - m_new);
  *l = *l * alpha + psum;
  *m = m_new;
  if (alpha != 1.f) {
    const VecF va = VecF::set1(alpha);
    int64_t e = 0;
    for (; e + VecF::N <= d; e += VecF::N) (VecF::load(acc + e) * va).store(acc + e);
    for (; e < d; ++e) acc[e] *= alpha;
  }
}

// One block's step of a row's online softmax: p[0, n) holds the raw scores of the keys the row
// sees in the block and becomes their probabilities exp(fma(s, scale, -m_new)); the running max *m
// and sum *l move on, and the accumulator acc[0, d) is rescaled where the max moved. The max is
// taken over the raw scores and the scale applied in the exp pass's multiply-add, one pass over
// p fewer than scaling them in place first (a 2,048-token float32 prefill's attention, AMD EPYC
// Zen 4, the two builds taking turns: 31.2 -> 30.6 ms a layer in medians, 30.8 -> 29.2 best).
// Vector steps in fixed chunks of the key index from the row's first key in the block, which
// depends only on the row's position: a row gets the same bits on every path. Always inlined:
// called per (row, head) and block, out of line it costs the float32 prefill's attention about 5%.
[[gnu::always_inline]] inline void online_softmax(float* p, int64_t n, float scale, float softcap, float* m,
                                                  float* l, float* acc, int64_t d) {
  float fold;
  const float m_new = std::max(*m, softmax_block_max(p, n, scale, softcap, fold));
  softmax_block_fold(m_new, softmax_block_exp(p, n, fold, m_new), m, l, acc, d);
}

// The arguments of one call (see paged_attention_impl); AttnShape is what the block steps need.
struct AttnShape {
  int64_t d, bs, window;
  float scale, softcap;
  // the first key a row at position pos sees (a sliding window's, else key 0)
  int64_t first_key(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
};
template <typename T> struct AttnArgs : AttnShape {
  float* out;
  const float* q;
  const T *k_cache, *v_cache;
  const int32_t *block_tables, *seq_lens, *qsl;
  int64_t max_blocks, num_seqs, hq, hk, group, q_off, q_stride, out_stride;
  float k_scale, v_scale;
};

// float, bfloat16 and float16 tiles are widened in registers by the micro-kernels; float8 or
// scaled tiles are widened once per block into float buffers.
template <typename T>
constexpr bool kWidenInRegisters = std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

// Whether a decode's work items take one query head each rather than a kv head's whole group,
// given `items` whole-group items over `threads`. Bits are the same either way (one chain per
// (row, head)); only the time differs. A one-row item waits on FMA latency: its group's heads
// share every key and value load and fill the FMA pipes together, so a whole-group item costs
// about (1 + group) / 2 single-head items (SmolLM2's group of 3 on two threads, ~140 tokens of
// context: 9 single-head items took 13 us a layer, 5 on one thread, so 2.6 us each; 3 whole-group
// items 10.5 us, 2 on one thread, so 5.25 us each).
// Split only where that finishes sooner, i.e. where whole groups leave most threads idle.
inline bool split_decode_heads(int64_t items, int64_t group, int64_t threads) {
  if (group <= 1) return false;
  const int64_t whole = (items + threads - 1) / threads * (1 + group);  // in half single-head items
  const int64_t split = (items * group + threads - 1) / threads * 2;
  return split < whole;
}

// Whether a call's decode rows take one item a sequence, all its kv heads block by block
// (attend_whole_block), rather than one item a kv head. A block's kv heads' tiles lie side by side
// in the cache (kernels/cache.hpp), so such an item reads each block's keys, then its values, as
// streams hk tiles long, where an item a kv head read one tile (16 KB in bfloat16, 32 in float32)
// and jumped to another block: from memory, 2 threads reading random 16 KB runs got 19.5 GB/s, 48
// KB runs 27-31 and 1 MB runs 34-35 (AMD EPYC Zen 4). With each block's value pages and the next
// block's key pages started ahead (fetch_pages), decode attention a layer, SmolLM2's 3 kv heads,
// 30 layers' caches from memory, blocks shuffled, the two taking turns in one process (medians of
// 11): bfloat16 64 sequences of 136 / 200 tokens 0.86x / 0.89x the time, 16 of 144 0.83x; float32
// 64 of 200 0.92x, 16 of 144 0.96x, 4 of 500 0.91x (the items alone); the page fetches a further
// 0.94-0.97x. The same chains, the same bits.
// Not where whole sequences would share the threads unevenly (a thread's share more than 1/8 above
// the kv heads' items'), nor on a tensor-parallel rank holding part of a group, nor on the paths
// that widen a block into buffers or take AMX tiles.
template <typename T>
inline bool whole_sequence_items(const AttnArgs<T>& a, AttnPath path) {
  return a.hk > 1 && a.q_off == 0 && a.hq == a.hk * a.group && (path == AttnPath::direct || path == AttnPath::pairs);
}
template <typename T>
inline bool whole_sequences(const AttnArgs<T>& a, AttnPath path, int64_t threads) {
  if (!whole_sequence_items(a, path)) return false;
  const int64_t whole = (a.num_seqs + threads - 1) / threads * a.hk;
  const int64_t split = (a.num_seqs * a.hk + threads - 1) / threads;
  return whole * 8 <= split * 9;
}

// Where an item's rows sit and which cache blocks they read.
struct ItemSpan {
  int64_t first_pos, last_pos;   // first row's and last row's positions
  int64_t first_blk, end_blk;    // the blocks read: [first_blk, end_blk), one partition's of a partition item
  template <typename T>
  static ItemSpan of(const AttnArgs<T>& a, const AttnItem& w) {
    const int64_t q_len = a.qsl[w.seq + 1] - a.qsl[w.seq];
    const int64_t first_pos = a.seq_lens[w.seq] - q_len + w.row0, last_pos = first_pos + w.rows - 1;
    ItemSpan sp{first_pos, last_pos, a.first_key(first_pos) / a.bs, last_pos / a.bs + 1};
    if (w.part >= 0) {
      const int64_t pb = partition_blocks(a.bs);
      sp.first_blk = std::max<int64_t>(sp.first_blk, w.part * pb);
      sp.end_blk = std::min<int64_t>(sp.end_blk, (w.part + 1) * pb);
    }
    return sp;
  }
};

// An item's time relative to the others', for choosing how a call is cut (attention_items), in
// units of one key of one kv head read for one decode row by a whole-sequence item, the cache in
// memory (a thread's 27 ns in float32, 19 in bfloat16: one sequence's decode at 7,500 tokens, AMD
// EPYC Zen 4). Reads: keys x kv heads, 1.45x on an item a kv head (a tile at a time: two decodes of
// 7,500 tokens, 30 layers' caches in turn, 27.0 against 18.2 ms; nine of 3,000 48.6 against 34.5),
// and (1 + n) / (1 + group) of that for n of a group's query heads (split_decode_heads). Arithmetic:
// 0.1 a key, row and query head (a 2,048-token prefill's attention: 2.7 ns a thread in float32, 1.6
// in bfloat16), where that is more. Every item 64 keys a kv head more: long sequences sharing the
// threads evenly took 1.01-1.03x the time cut into partitions. The middle row's keys stand for the
// rows'.
template <typename T>
inline double item_cost(const AttnArgs<T>& a, const AttnItem& w) {
  const ItemSpan sp = ItemSpan::of(a, w);
  const int64_t mid = (sp.first_pos + sp.last_pos) / 2;
  const int64_t lo = std::max(a.first_key(mid), sp.first_blk * a.bs);
  const double keys = static_cast<double>(std::max<int64_t>(0, std::min(mid + 1, sp.end_blk * a.bs) - lo));
  const int64_t heads = w.g1 - w.g0;
  const double reads = w.nkv > 1 ? w.nkv : 1.45 * static_cast<double>(1 + heads) / static_cast<double>(1 + a.group);
  return (keys + 64.0) * std::max(reads, 0.1 * static_cast<double>(w.rows * heads));
}

// The first and the last partition of the keys that sequence s's last row reads.
template <typename T>
inline std::pair<int32_t, int32_t> last_row_partitions(const AttnArgs<T>& a, int64_t s) {
  const int64_t pos = a.seq_lens[s] - 1, keys = partition_blocks(a.bs) * a.bs;
  return {static_cast<int32_t>(a.first_key(pos) / keys), static_cast<int32_t>(pos / keys)};
}

// Sequence s's decode row as one item a partition of its keys, each with its own partial slot
// (slots counts them): all its kv heads in an item where `whole` (whole_sequence_items), else an
// item a kv head and partition. False, nothing added, where its keys are one partition.
template <typename T>
inline bool add_partition_items(const AttnArgs<T>& a, int32_t s, bool whole, std::vector<AttnItem>& items,
                                int32_t& slots) {
  const auto [p0, p1] = last_row_partitions(a, s);
  if (p1 == p0) return false;
  if (whole) {
    for (int32_t p = p0; p <= p1; ++p)
      items.push_back({s, 0, 0, 1, 0, static_cast<int32_t>(a.hq), static_cast<int32_t>(a.hk), p, slots++});
    return true;
  }
  for (int32_t h = 0; h < a.hk; ++h) {
    const int32_t ga = static_cast<int32_t>(std::max<int64_t>(0, h * a.group - a.q_off));
    const int32_t gb = static_cast<int32_t>(std::min<int64_t>(a.hq, (h + 1) * a.group - a.q_off));
    if (ga >= gb) continue;
    for (int32_t p = p0; p <= p1; ++p) items.push_back({s, h, 0, 1, ga, gb, 1, p, slots++});
  }
  return true;
}

// Whether sequence s's decode row reads keys of more than one partition.
template <typename T>
inline bool spans_partitions(const AttnArgs<T>& a, int64_t s) {
  if (a.qsl[s + 1] - a.qsl[s] != 1) return false;
  const auto [p0, p1] = last_row_partitions(a, s);
  return p0 != p1;
}

// How a call's rows are cut into items: its decode rows one item a query head (split_heads), a
// sequence (whole_seqs) or else a kv head, those of more than one partition an item a partition
// (by_partition: a sequence's or else a kv head's, as whole_parts), prefill rows a kQTile of rows
// a kv head.
struct AttnCut { bool split_heads, whole_seqs, by_partition, whole_parts; };

// The work list of cut c into items, slots counting the partition items' partial states.
template <typename T>
inline void cut_items(const AttnArgs<T>& a, AttnCut c, std::vector<AttnItem>& items, int32_t& slots) {
  items.clear();
  slots = 0;
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int32_t q_len = a.qsl[s + 1] - a.qsl[s];
    if (q_len == 1 && c.by_partition && add_partition_items(a, static_cast<int32_t>(s), c.whole_parts, items, slots))
      continue;
    if (q_len == 1 && c.whole_seqs) {
      items.push_back({static_cast<int32_t>(s), 0, 0, 1, 0, static_cast<int32_t>(a.hq), static_cast<int32_t>(a.hk)});
      continue;
    }
    for (int32_t r = 0; r < q_len; r += kQTile)
      for (int32_t h = 0; h < a.hk; ++h) {
        const int32_t rows = std::min<int32_t>(kQTile, q_len - r);
        // this kv head's query heads, as local indices
        const int32_t ga = static_cast<int32_t>(std::max<int64_t>(0, h * a.group - a.q_off));
        const int32_t gb = static_cast<int32_t>(std::min<int64_t>(a.hq, (h + 1) * a.group - a.q_off));
        if (ga >= gb) continue;
        if (q_len == 1 && c.split_heads) {
          for (int32_t g = ga; g < gb; ++g) items.push_back({static_cast<int32_t>(s), h, r, rows, g, g + 1});
        } else {
          items.push_back({static_cast<int32_t>(s), h, r, rows, ga, gb});
        }
      }
  }
}

// When the threads, claiming items in order, finish a call's items (shares.hpp claimed_finish,
// item_cost's units).
template <typename T>
inline double items_finish(const AttnArgs<T>& a, const std::vector<AttnItem>& items, int64_t threads) {
  return claimed_finish(static_cast<int64_t>(items.size()), threads,
                        [&](int64_t i) { return item_cost(a, items[static_cast<size_t>(i)]); });
}

// The work list, rebuilt per call in storage reused across calls (no allocation once warm).
// Local query head i attends with kv head (i + q_off) / group: with q_off = 0 and
// hq = hk * group this is plain GQA; a tensor-parallel rank holding part of a
// group passes where its first query head sits inside its first kv head's group.
// Decode rows of more than one partition take an item a partition (flash-decoding) where the
// threads, claiming items in order, finish sooner that way by item_cost: a long sequence beside
// short ones, or too few sequences for the threads. Bits are the same either way (merge_state, in
// partition order); only the time differs. Float32 decode attention, SmolLM2's 3 kv heads, 30
// layers' caches from memory (AMD EPYC Zen 4, 2 threads, the cuts taking turns in one process,
// medians of 7), against the rule before (split where the items were fewer than the threads or
// too few to share evenly): sequences of 7,500 and 200 tokens 16.6 -> 9.7 ms, 7,500 and 3 x 200
// 16.6 -> 10.0, 3 x 3,000 16.8 -> 11.8, 9 x 3,000 34.7 -> 32.4; a 256-token prompt's chunk then a
// decode at 7,500 (8 layers) 13.8 -> 11.9; one of 7,500 9.7 either way. Evenly shared ones stay
// whole (16 x 2,500, 32 x 2,100 and 8 x 4,100 took 1.01-1.03x the time cut into partitions).
// Through the engine, the default Q4_1 model's decode steps of a 6,500-token sequence beside a
// 20-token one: 18.5-19.3 -> 15.4-15.6 ms (the builds taking turns by process, medians of 80).
template <typename T>
inline const std::vector<AttnItem>& attention_items(const AttnArgs<T>& a, AttnPath path, int32_t& slots) {
  int64_t group_items = 0, spanning = 0;
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    group_items += (a.qsl[s + 1] - a.qsl[s] + kQTile - 1) / kQTile * a.hk;
    spanning += spans_partitions(a, s);
  }
  const int64_t threads = omp_get_max_threads();
  AttnCut cut{split_decode_heads(group_items, a.group, threads), false, false, whole_sequence_items(a, path)};
  cut.whole_seqs = !cut.split_heads && whole_sequences(a, path, threads);
  static thread_local std::vector<AttnItem> items, parts;
  cut_items(a, cut, items, slots);
  if (threads > 1 && spanning > 0) {
    int32_t part_slots = 0;
    cut.by_partition = true;
    cut_items(a, cut, parts, part_slots);
    if (items_finish(a, parts, threads) < items_finish(a, items, threads)) {
      items.swap(parts);
      slots = part_slots;
    }
  }
  return items;
}

// A thread's scratch for its work items, sized once for the largest shape seen: per (row, head)
// of a tile the online softmax's running max m, sum l and accumulator acc, the query vectors, a
// block's scores, and the blocks widened or paired into buffers.
struct TileScratch {
  float* acc;   // [rows][group][d]
  float* m;     // [rows][group]
  float* l;     // [rows][group]
  float* tacc;  // [rows][group][d] the partitions merged so far (merge_state), with tm and tl
  float* tm;    // [rows][group]
  float* tl;    // [rows][group]
  float* sblk;  // [rows][group][bs] a block's scores, then probabilities
  float* kbuf;  // [d][bs] keys as float (float8 or scaled caches)
  float* vbuf;  // [bs][d] values as float
  // the pair and AMX paths: queries [rows][group][d] and probabilities [rows][group][bs] in
  // bfloat16; AMX's values steps at a block's ends, their outside keys zeroed, in vbuf
  bf16* qb;
  bf16* pb;
  const float** qptr;    // [rows][group] the tile's query vectors
  const bf16x2** qpair;  // the same, rounded to bfloat16 pairs (qb)
  int* tiles;            // the rows the AMX tiles are configured for (0: not configured)

  // Each part on a cache line of its own (LineVector, sizes rounded up to whole lines): the AMX
  // path's tile loads and stores read and write rows of acc, sblk, qb and pb, and a row crossing
  // a line costs two.
  static TileScratch for_this_thread(int64_t group, int64_t d, int64_t bs) {
    static thread_local LineVector<float> scratch;
    static thread_local std::vector<const float*> qptr;
    static thread_local std::vector<const bf16x2*> qpair;
    static thread_local int tiles = 0;
    const int64_t tile = kQTile * group;
    auto lines = [](int64_t floats) { return (floats + 15) / 16 * 16; };
    const int64_t sizes[] = {tile * d, tile, tile, tile * bs, bs * d, bs * d, (tile * d + 1) / 2, (tile * bs + 1) / 2,
                             tile * d, tile, tile};
    constexpr int kParts = sizeof(sizes) / sizeof(sizes[0]);
    int64_t need = 0;
    for (const int64_t n : sizes) need += lines(n);
    if (scratch.size() < static_cast<size_t>(need)) scratch.resize(static_cast<size_t>(need));
    if (qptr.size() < static_cast<size_t>(tile)) qptr.resize(static_cast<size_t>(tile));
    if (qpair.size() < qptr.size()) qpair.resize(qptr.size());
    float* part[kParts];
    part[0] = scratch.data();
    for (int i = 1; i < kParts; ++i) part[i] = part[i - 1] + lines(sizes[i - 1]);
    TileScratch t;
    t.acc = part[0];
    t.m = part[1];
    t.l = part[2];
    t.sblk = part[3];
    t.kbuf = part[4];
    t.vbuf = part[5];
    t.qb = reinterpret_cast<bf16*>(part[6]);
    t.pb = reinterpret_cast<bf16*>(part[7]);
    t.tacc = part[8];
    t.tm = part[9];
    t.tl = part[10];
    t.qptr = qptr.data();
    t.qpair = qpair.data();
    t.tiles = &tiles;
    return t;
  }
  // The scratch of a one-row item's heads from head i0 on (heads side by side: [1][heads][...]).
  TileScratch heads(int64_t i0, int64_t d, int64_t bs) const {
    TileScratch h = *this;
    h.acc += i0 * d;
    h.m += i0;
    h.l += i0;
    h.tacc += i0 * d;
    h.tm += i0;
    h.tl += i0;
    h.sblk += i0 * bs;
    h.qb += i0 * d;
    h.pb += i0 * bs;
    h.qptr += i0;
    h.qpair += i0;
    return h;
  }
};

// A work item against one cache block: the tile's rows and heads, and the keys they see.
struct BlockView {
  int64_t rows, ng;        // the tile's rows, and query heads per row
  int64_t first_pos;       // position of the tile's first row
  int64_t base;            // position of the block's first key
  int64_t blk_lo, blk_hi;  // keys some row sees, relative to base (inclusive)
  int64_t c_lo, c_hi;      // the key vectors holding them
  bool whole;              // every row sees every key of the block

  static BlockView at(int64_t rows, int64_t ng, int64_t first_pos, int64_t base, const AttnShape& s) {
    const int64_t last_pos = first_pos + rows - 1;
    BlockView b{rows, ng, first_pos, base, 0, 0, 0, 0, false};
    b.blk_lo = std::max<int64_t>(base, s.first_key(first_pos)) - base;
    b.blk_hi = std::min<int64_t>(base + s.bs - 1, last_pos) - base;
    b.c_lo = b.blk_lo / VecF::N;
    b.c_hi = b.blk_hi / VecF::N;
    b.whole = first_pos >= base + s.bs - 1 && (s.window <= 0 || last_pos - s.window + 1 <= base);
    return b;
  }
  // keys [lo, hi] that row r sees, relative to base (lo > hi: none)
  std::pair<int64_t, int64_t> row_keys(int64_t r, const AttnShape& s) const {
    const int64_t pos = first_pos + r;
    return {std::max<int64_t>(base, s.first_key(pos)) - base,
            std::min<int64_t>(base + s.bs - 1, pos) - base};
  }
};

#if defined(__AVX512F__) || defined(__AVX2__)
// Whether this table's blocks take block_softmax.hpp's step, 16 (row, head)s at a time, rather than
// online_softmax row by row: every AVX-512 table, on every path, and AVX2. Float32 attention a
// layer (AMD EPYC Zen 5, 2 threads, old and new in one binary taking turns, medians of 9): prefill
// 2,048 tokens 0.93x the time, 512 tokens 0.91x, decode 64 sequences of 200 tokens 0.98-0.99x.
constexpr bool kBlockSoftmax = true;
#else
constexpr bool kBlockSoftmax = false;
#endif

// e^x, or 2^x where this table's softmax keeps its running max in base 2 (block_softmax.hpp).
inline float softmax_pow(float x) { return kBlockSoftmax ? std::exp2(x) : std::exp(x); }

// A (row, head)'s total (tm, tl, tacc[0, d)) merged with its next partition's state (m, l, acc):
// both rescaled to the larger max (a state without keys, m = -inf and l = 0, leaves the total as it
// is). The total starts as the first partition's state itself, so a row of one partition gets the
// bits it had before partitions. The one merge of every path and order.
inline void merge_state(float& tm, float& tl, float* tacc, float m, float l, const float* acc, int64_t d) {
  const float mx = std::max(tm, m);
  const float a = tm == mx ? 1.f : softmax_pow(tm - mx), b = m == mx ? 1.f : softmax_pow(m - mx);
  tl = tl * a + l * b;
  tm = mx;
  const VecF va = VecF::set1(a), vb = VecF::set1(b);
  int64_t e = 0;
  for (; e + VecF::N <= d; e += VecF::N) VecF::fma(VecF::load(acc + e), vb, VecF::load(tacc + e) * va).store(tacc + e);
  for (; e < d; ++e) tacc[e] = std::fma(acc[e], b, tacc[e] * a);
}

// The output of a (row, head): its total's accumulator over its sum (0 where it saw no key).
inline void write_state(float* o, float tl, const float* tacc, int64_t d) {
  const float inv = tl > 0.f ? 1.f / tl : 0.f;
  for (int64_t e = 0; e < d; ++e) o[e] = tacc[e] * inv;
}

// The (row, head)s [m0, m0 + mr) of a block (mr <= 16) through its online softmax step
// (block_softmax.hpp: base 2, the rows' reductions transposed, the probabilities stored by the exp
// pass into probs, [rows][group][bs] like the scores: the scores themselves for float ones), their
// accumulators rescaled where their max moved; [lo[r], hi[r]] the keys of row m0 + r (lo > hi:
// none). On this step m is kept in base 2 (scaled by log2(e)).
template <typename P>
inline void softmax_rows16(const AttnShape& s, const TileScratch& t, const BlockView& b, int64_t m0, int mr, P* probs,
                           int64_t* lo, int64_t* hi) {
#if defined(__AVX512F__) || defined(__AVX2__)
  const int64_t d = s.d, bs = s.bs;
  block_softmax::Rows16<P> rows;
  for (int r = 0; r < mr; ++r) {
    const int64_t i = m0 + r;
    std::tie(lo[r], hi[r]) = b.row_keys(i / b.ng, s);
    rows.n[r] = hi[r] - lo[r] + 1;
    rows.u[r] = t.sblk + i * bs + lo[r];
    rows.p[r] = probs + i * bs + lo[r];
  }
  float alpha[16];
  block_softmax::step(rows, mr, s.scale, s.softcap, t.m + m0, t.l + m0, alpha);
  for (int r = 0; r < mr; ++r) {
    if (alpha[r] == 1.f) continue;
    float* acc = t.acc + (m0 + r) * d;
    const VecF va = VecF::set1(alpha[r]);
    int64_t e = 0;
    for (; e + VecF::N <= d; e += VecF::N) (VecF::load(acc + e) * va).store(acc + e);
    for (; e < d; ++e) acc[e] *= alpha[r];
  }
#endif
}

// Which of a block's steps a call runs: all three in turn, or one of them for every kv head of a
// decode row before the next (attend_whole_block).
enum BlockSteps { kScores = 1, kSoftmax = 2, kValues = 4, kAllSteps = 7 };

// One block of a work item on the FMA path: the scores, each (row, head)'s online softmax step,
// then the values, for all rows and heads at once when every row sees the whole block (the same
// chains as row by row).
template <typename E>
inline void attend_block(const AttnShape s, const TileScratch& t, const BlockView b, const E* kt, const E* vt,
                         int steps = kAllSteps) {
  const int64_t d = s.d, bs = s.bs, n_rows = b.rows * b.ng;
  if (steps & kScores) block_scores(t.qptr, n_rows, TileRows<E>::keys(kt, bs), bs, d, b.c_lo, b.c_hi, t.sblk);
  if (steps & kSoftmax) {
    for (int64_t m0 = 0; m0 < n_rows; m0 += 16) {
      if constexpr (kBlockSoftmax) {
        int64_t lo[16], hi[16];
        softmax_rows16(s, t, b, m0, static_cast<int>(std::min<int64_t>(16, n_rows - m0)), t.sblk, lo, hi);
      } else {
        for (int64_t i = m0; i < std::min(n_rows, m0 + 16); ++i) {
          const auto [k_lo, k_hi] = b.row_keys(i / b.ng, s);
          if (k_lo <= k_hi)
            online_softmax(t.sblk + i * bs + k_lo, k_hi - k_lo + 1, s.scale, s.softcap, t.m + i, t.l + i,
                           t.acc + i * d, d);
        }
      }
    }
  }
  if (!(steps & kValues)) return;
  if (b.whole) return accumulate_values(t.acc, t.sblk, bs, n_rows, TileRows<E>::values(vt, d, 0), bs, d);
  for (int64_t r = 0; r < b.rows; ++r) {
    const auto [k_lo, k_hi] = b.row_keys(r, s);
    if (k_lo > k_hi) continue;
    accumulate_values(t.acc + r * b.ng * d, t.sblk + r * b.ng * bs + k_lo, bs, b.ng, TileRows<E>::values(vt, d, k_lo),
                      k_hi - k_lo + 1, d);
  }
}

#ifdef __AVX512BF16__
// One block of a work item on the bfloat16 pair path (vdpbf16ps), straight from the paired tiles:
// keys paired over e, values over the keys (a pair partner outside the block's keys zero: its
// probability is zero for every row), then attend_block's steps on pairs, the softmax 16 (row,
// head)s at a time (softmax_rows16), where online_softmax took them one by one: a bfloat16 prefill's
// attention a layer (AMD EPYC Zen 5; old and new in one binary taking turns, medians of 11), 2,048
// tokens 0.89-0.91x the time on 2 threads and 1, 512 tokens 0.82-0.88x; decode (64 sequences of 200
// tokens, one of 1,000) 0.95-1.01x. Outputs move by at most 2e-5.
inline void attend_block_pairs(const AttnShape s, const TileScratch& t, const BlockView b, const bf16* kt,
                               const bf16* vt, int steps = kAllSteps) {
  const int64_t d = s.d, bs = s.bs, d2 = d / 2, b2 = bs / 2, n_rows = b.rows * b.ng;
  const bf16x2* vp = pairs_of(vt);
  const bf16x2* pp = reinterpret_cast<const bf16x2*>(t.pb);  // [rows][group][bs / 2]
  if (steps & kScores) block_scores(t.qpair, n_rows, Rows<bf16x2>{pairs_of(kt), bs}, bs, d2, b.c_lo, b.c_hi, t.sblk);
  for (int64_t m0 = 0; m0 < n_rows && (steps & kSoftmax); m0 += 16) {
    const int mr = static_cast<int>(std::min<int64_t>(16, n_rows - m0));
    int64_t lo[16], hi[16];
    softmax_rows16(s, t, b, m0, mr, t.pb, lo, hi);
    for (int r = 0; r < mr; ++r) {  // the partner of an end key outside the row's keys: zero
      bf16* p = t.pb + (m0 + r) * bs;
      if (lo[r] > hi[r]) continue;
      if (lo[r] % 2) p[lo[r] - 1] = bf16{0};
      if (hi[r] % 2 == 0) p[hi[r] + 1] = bf16{0};
    }
  }
  if (!(steps & kValues)) return;
  if (b.whole) return accumulate_values(t.acc, pp, b2, n_rows, Rows<bf16x2>{vp, d}, b2, d);
  for (int64_t r = 0; r < b.rows; ++r) {
    const auto [k_lo, k_hi] = b.row_keys(r, s);
    if (k_lo > k_hi) continue;
    const int64_t j0 = k_lo / 2, nj = k_hi / 2 - k_lo / 2 + 1;
    const MaskedPairs v{vp + j0 * d, d, b.blk_lo - 2 * j0, b.blk_hi - 2 * j0};
    accumulate_values(t.acc + r * b.ng * d, pp + r * b.ng * b2 + j0, b2, b.ng, v, nj, d);
  }
}

#ifdef __AMX_BF16__
// Attention on AMX tiles (the amx table), for every row of a call, one decode row or a prefill's
// 48: tdpbf16ps' sums are not vdpbf16ps' (amx.hpp), so the two paths never mix. The operands are
// the pair path's, read in place: queries in bfloat16 (qb, the A tiles of the scores), the paired
// key tile ([d / 2][bs] pairs over e: B tiles of 16 pairs by 16 keys), probabilities in bfloat16
// (pb, the A tiles of the values) and the paired value tile ([bs / 2][d] pairs over keys: B tiles
// of 16 key pairs by 16 elements). Tiles: C 0-3 (up to 16 rows of 16 scores or accumulator
// elements), A 4-5, B 6-7, all configured for the chunk's rows (amx_configure(mr, mr)).
// Tiles for mr rows, configured where the shape changes (released at the end of the call).
inline void amx_attention_rows(int mr, const TileScratch& t) {
  if (*t.tiles == mr) return;
  amx_configure(mr, mr);
  *t.tiles = mr;
}

// s[i][c * 16, c * 16 + 16) = q_i . k over key vectors c in [c_lo, c_hi], for the configured rows
// i of q (rows d bfloat16 apart), keys kp paired over e ([d / 2][kbs]); s's rows ss floats apart.
// Each score: d / 32 tile steps over e in order from zero.
inline void amx_scores(const bf16* q, int64_t d, const bf16x2* kp, int64_t kbs, int64_t c_lo, int64_t c_hi, float* s,
                       int64_t ss) {
  for (int64_t c = c_lo; c <= c_hi; c += 4) {
    const int64_t nc = std::min<int64_t>(4, c_hi + 1 - c);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t e = 0; e < d / 2; e += kTilePairs) {
      _tile_loadd(4, q + 2 * e, d * 2);
      const bf16x2* k = kp + e * kbs + c * VecF::N;
      _tile_loadd(6, k, kbs * 4);
      _tile_dpbf16ps(0, 4, 6);
      if (nc > 1) {
        _tile_loadd(7, k + 16, kbs * 4);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (nc > 2) {
        _tile_loadd(6, k + 32, kbs * 4);
        _tile_dpbf16ps(2, 4, 6);
      }
      if (nc > 3) {
        _tile_loadd(7, k + 48, kbs * 4);
        _tile_dpbf16ps(3, 4, 7);
      }
    }
    float* o = s + c * VecF::N;
    _tile_stored(0, o, ss * 4);
    if (nc > 1) _tile_stored(1, o + 16, ss * 4);
    if (nc > 2) _tile_stored(2, o + 32, ss * 4);
    if (nc > 3) _tile_stored(3, o + 48, ss * 4);
  }
}

// Where a step's values steps' B tiles come from: the value tile of the step's block holding them
// for a step of keys all inside [lo, hi] (relative to the step's first key), else its masked copy
// in `edge`: the step's first values step at edge[0], its last at edge[16 * d] (the same at
// edge[0] where they are one).
struct AmxValues {
  const bf16x2* const* tiles;  // the step's blocks' value tiles, paired over keys
  const bf16x2* edge;
  int64_t bs, lo, hi, j_first;
  bool inside(int64_t j) const { return j >= lo && j + kAmxKeys - 1 <= hi; }
  const bf16x2* step(int64_t j, int64_t d) const {
    if (inside(j)) return tiles[j / bs] + j % bs / 2 * d;
    return edge + (j == j_first ? 0 : kAmxKeys / 2 * d);
  }
};

// acc_i[0, d) += p_i[j0, j1) . v[j0, j1) for the configured rows i (acc's rows d floats apart,
// p's bfloat16 rows ps apart); j0, j1 whole steps of 32 keys. Each element: its accumulator
// loaded, one tile step a 32 keys in key order, stored.
inline void amx_values(float* acc, int64_t d, const bf16* p, int64_t ps, const AmxValues& vs, int64_t j0, int64_t j1) {
  for (int64_t e0 = 0; e0 < d; e0 += 64) {
    const int64_t ne = std::min<int64_t>(4, (d - e0) / 16);
    float* o = acc + e0;
    _tile_loadd(0, o, d * 4);
    if (ne > 1) _tile_loadd(1, o + 16, d * 4);
    if (ne > 2) _tile_loadd(2, o + 32, d * 4);
    if (ne > 3) _tile_loadd(3, o + 48, d * 4);
    for (int64_t j = j0; j < j1; j += kAmxKeys) {
      _tile_loadd(5, p + j, ps * 2);
      const bf16x2* v = vs.step(j, d) + e0;
      _tile_loadd(6, v, d * 4);
      _tile_dpbf16ps(0, 5, 6);
      if (ne > 1) {
        _tile_loadd(7, v + 16, d * 4);
        _tile_dpbf16ps(1, 5, 7);
      }
      if (ne > 2) {
        _tile_loadd(6, v + 32, d * 4);
        _tile_dpbf16ps(2, 5, 6);
      }
      if (ne > 3) {
        _tile_loadd(7, v + 48, d * 4);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, o, d * 4);
    if (ne > 1) _tile_stored(1, o + 16, d * 4);
    if (ne > 2) _tile_stored(2, o + 32, d * 4);
    if (ne > 3) _tile_stored(3, o + 48, d * 4);
  }
}

// A row's bfloat16 probabilities over the key steps [j0, j1) zero outside its keys [k_lo, k_hi]
// (k_lo > k_hi: the row sees none of the block, all zero).
inline void zero_unseen_probabilities(int64_t k_lo, int64_t k_hi, int64_t j0, int64_t j1, bf16* dst) {
  if (k_lo > k_hi) k_lo = k_hi = j1;
  for (int64_t j = j0; j < std::min(k_lo, j1); ++j) dst[j] = bf16{0};
  for (int64_t j = k_hi + 1; j < j1; ++j) dst[j] = bf16{0};
}

// The chunk's rows [m0, m0 + mr) through one block's softmax step (softmax_rows16), and each row's
// probabilities zero over the key steps [j0, j1) outside its keys.
inline void amx_softmax_rows(const AttnShape& s, const TileScratch& t, const BlockView& b, int64_t m0, int mr,
                             int64_t j0, int64_t j1) {
  int64_t lo[16], hi[16];
  softmax_rows16(s, t, b, m0, mr, t.pb, lo, hi);
  for (int r = 0; r < mr; ++r) zero_unseen_probabilities(lo[r], hi[r], j0, j1, t.pb + (m0 + r) * s.bs);
}

// The blocks of one online softmax step on tiles (up to kAmxStepBlocks of a sequence's blocks, in
// key order: amx_step_blocks): their key and value tiles.
struct AmxStep {
  const bf16* kt[kAmxStepBlocks];
  const bf16* vt[kAmxStepBlocks];
  int64_t n;
};

// One online softmax step of a work item on tiles, over the keys of st's blocks (b: the step's view,
// its keys relative to the step's first, rows of scores and probabilities st.n * bs apart): the
// values steps of 32 keys that hold keys outside [blk_lo, blk_hi] copied with those zeroed (vbuf),
// then in chunks of 16 (row, head)s the scores block by block, each one's softmax step over all of
// them and the values, the tiles read in place.
inline void attend_step_amx(const AttnShape s, const TileScratch& t, const BlockView b, const AmxStep& st) {
  const int64_t d = s.d, bs = s.bs, w = st.n * bs, n_rows = b.rows * b.ng;
  AttnShape ws = s;  // the step as one block, for the softmax's rows
  ws.bs = w;
  const int64_t j0 = b.blk_lo / kAmxKeys * kAmxKeys, j1 = (b.blk_hi / kAmxKeys + 1) * kAmxKeys;
  const bf16x2* vtiles[kAmxStepBlocks];
  for (int64_t g = 0; g < st.n; ++g) vtiles[g] = pairs_of(st.vt[g]);
  const AmxValues vs{vtiles, reinterpret_cast<const bf16x2*>(t.vbuf), bs, b.blk_lo, b.blk_hi, j0};
  auto copy_edge = [&](int64_t j, int64_t slot) {
    if (vs.inside(j)) return;
    const int64_t g = j / bs, r0 = j % bs / 2;
    const MaskedPairs masked{vtiles[g], d, b.blk_lo - g * bs, b.blk_hi - g * bs};
    for (int64_t r = 0; r < kAmxKeys / 2; ++r)
      for (int64_t e = 0; e < d; e += VecF::N) masked.at(r0 + r, e).store(t.vbuf + (slot * kAmxKeys / 2 + r) * d + e);
  };
  copy_edge(j0, 0);
  if (j1 - kAmxKeys != j0) copy_edge(j1 - kAmxKeys, 1);
  // Each phase for every chunk before the next phase: going from tile code to vector code or back
  // costs about 250 cycles a time here (not a data dependence: the same with the buffers apart),
  // and the phases taken chunk by chunk made 6 such turns a step of a 48-row item where these make
  // 2 (the real phases on one hot block: 5.2 -> 4.65 us for 48 rows; a 2,048-token prefill's
  // attention, old and new in one binary in turns: 0.85-0.89x, 1 and 2 threads). Scores and
  // softmax interleaved chunk by chunk within a step of four blocks: level.
  auto rows_of = [&](int64_t m0) { return static_cast<int>(std::min<int64_t>(16, n_rows - m0)); };
  const int64_t vpb = bs / VecF::N;  // key vectors a block
  for (int64_t m0 = 0; m0 < n_rows; m0 += 16) {
    amx_attention_rows(rows_of(m0), t);
    for (int64_t g = 0; g < st.n; ++g) {
      const int64_t c_lo = std::max(b.c_lo, g * vpb), c_hi = std::min(b.c_hi, g * vpb + vpb - 1);
      if (c_lo <= c_hi)
        amx_scores(t.qb + m0 * d, d, pairs_of(st.kt[g]), bs, c_lo - g * vpb, c_hi - g * vpb,
                   t.sblk + m0 * w + g * bs, w);
    }
  }
  for (int64_t m0 = 0; m0 < n_rows; m0 += 16) amx_softmax_rows(ws, t, b, m0, rows_of(m0), j0, j1);
  for (int64_t m0 = 0; m0 < n_rows; m0 += 16) {
    amx_attention_rows(rows_of(m0), t);
    amx_values(t.acc + m0 * d, d, t.pb + m0 * w, w, vs, j0, j1);
  }
}
#endif  // __AMX_BF16__
#endif

// `steps` of one block on the paths that read the tiles in place, bfloat16 pairs or the FMA path
// widening in registers; false (nothing run) on the others, which widen a block into buffers or
// take AMX tiles.
template <typename T>
inline bool attend_in_place(const AttnShape s, const TileScratch& t, const BlockView& b, const T* kt, const T* vt,
                            AttnPath path, int steps = kAllSteps) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, bf16>) {
    if (path == AttnPath::pairs) {
      attend_block_pairs(s, t, b, kt, vt, steps);
      return true;
    }
  }
#endif
  if constexpr (kWidenInRegisters<T>) {
    if (path == AttnPath::direct) {
      attend_block(s, t, b, kt, vt, steps);
      return true;
    }
  }
  return false;
}

// One block of a work item (the cache tile at `tile`) on its dtype's path (but AMX tiles: their
// steps take several blocks, attend_amx_step).
template <typename T>
inline void attend_tile_block(const AttnArgs<T>& a, const TileScratch& t, const BlockView& b, int64_t tile,
                              AttnPath path) {
  const T* kt = a.k_cache + tile;
  const T* vt = a.v_cache + tile;
  if (attend_in_place(a, t, b, kt, vt, path)) return;
  // float8, or scaled: widened to float once per block
  const int64_t d = a.d, bs = a.bs;
  if constexpr (kPairedCache<T>) {  // (a scaled bfloat16 cache: element by element, out of its pairs)
    for (int64_t e = 0; e < d; ++e)
      for (int64_t j = b.c_lo * VecF::N; j < (b.c_hi + 1) * VecF::N; ++j)
        t.kbuf[e * bs + j] = to_float(kt[key_at<T>(e, j, bs)]) * a.k_scale;
    for (int64_t j = b.blk_lo; j <= b.blk_hi; ++j)
      for (int64_t e = 0; e < d; ++e) t.vbuf[j * d + e] = to_float(vt[value_at<T>(j, e, d)]) * a.v_scale;
    return attend_block(a, t, b, static_cast<const float*>(t.kbuf), static_cast<const float*>(t.vbuf));
  }
  for (int64_t e = 0; e < d; ++e)
    convert_to_float(t.kbuf + e * bs + b.c_lo * VecF::N, kt + e * bs + b.c_lo * VecF::N,
                     (b.c_hi - b.c_lo + 1) * VecF::N, a.k_scale);
  convert_to_float(t.vbuf + b.blk_lo * d, vt + b.blk_lo * d, (b.blk_hi - b.blk_lo + 1) * d, a.v_scale);
  attend_block(a, t, b, static_cast<const float*>(t.kbuf), static_cast<const float*>(t.vbuf));
}

// One block of a decode row's item over its sequence's nkv kv heads (whole_sequences), the heads'
// tiles side by side from `tile` on: every head's scores, then the softmax step of all the row's
// query heads at once, then every head's values (the same chains as head by head). The direct and
// pair paths only.
template <typename T>
inline void attend_whole_block(const AttnArgs<T>& a, const TileScratch& t, const AttnItem& w, const BlockView& b,
                               int64_t tile, AttnPath path) {
  const int64_t g = a.group, step = a.bs * a.d;
  BlockView all = b;
  all.ng = g * w.nkv;
  auto each_head = [&](int steps) {
    for (int64_t h = 0; h < w.nkv; ++h)
      attend_in_place(a, t.heads(h * g, a.d, a.bs), b, a.k_cache + tile + h * step, a.v_cache + tile + h * step,
                      path, steps);
  };
  fetch_pages(a.v_cache + tile, w.nkv * step);
  each_head(kScores);
  attend_in_place(a, t, all, a.k_cache, a.v_cache, path, kSoftmax);  // (the softmax reads no tile)
  each_head(kValues);
}

// A work item's start: running max -inf, sums and accumulators zero, the tile's query vectors
// (and, on the pair path, their bfloat16 pairs).
template <typename T>
inline void start_tile(const AttnArgs<T>& a, const AttnItem& w, const TileScratch& t, [[maybe_unused]] AttnPath path) {
  const int64_t d = a.d, ng = w.g1 - w.g0;
  for (int64_t i = 0; i < w.rows * ng; ++i) {
    t.m[i] = -std::numeric_limits<float>::infinity();
    t.l[i] = 0.f;
    std::fill(t.acc + i * d, t.acc + (i + 1) * d, 0.f);
  }
  for (int64_t r = 0; r < w.rows; ++r)
    for (int64_t g = w.g0; g < w.g1; ++g)
      t.qptr[r * ng + (g - w.g0)] = a.q + (a.qsl[w.seq] + w.row0 + r) * a.q_stride + g * d;
#ifdef __AVX512BF16__
  if (path == AttnPath::pairs || path == AttnPath::amx)
    for (int64_t i = 0; i < w.rows * ng; ++i) {
      for (int64_t e = 0; e < d; e += VecF::N) VecF::load(t.qptr[i] + e).store_bf16(t.qb + i * d + e);
      t.qpair[i] = reinterpret_cast<const bf16x2*>(t.qb + i * d);
    }
#endif
}

// A partition's end: each of the item's n (row, head) states merged into its total (the first
// partition's state becomes the total as it is), and started afresh.
[[gnu::noinline, gnu::cold]] void fold_partition(const TileScratch& t, int64_t n, int64_t d, bool first) {
  for (int64_t i = 0; i < n; ++i) {
    if (first) {
      t.tm[i] = t.m[i];
      t.tl[i] = t.l[i];
      std::copy(t.acc + i * d, t.acc + (i + 1) * d, t.tacc + i * d);
    } else {
      merge_state(t.tm[i], t.tl[i], t.tacc + i * d, t.m[i], t.l[i], t.acc + i * d, d);
    }
    t.m[i] = -std::numeric_limits<float>::infinity();
    t.l[i] = 0.f;
    std::fill(t.acc + i * d, t.acc + (i + 1) * d, 0.f);
  }
}

// Where in the call's partials a partition item (a decode row's, part >= 0) leaves its states:
// per head acc [d], m and l, a slot holding up to `heads` (the call's query heads).
inline int64_t partial_at(int64_t slot, int64_t heads, int64_t d) { return slot * heads * (d + 2); }

// A work item's end: each (row, head)'s accumulator over its sum into the output, its last
// partition merged into its total first where the item crossed a partition's end (`folded`); a
// partition item's states go to its slot instead.
template <typename T>
inline void finish_tile(const AttnArgs<T>& a, const AttnItem& w, const TileScratch& t, bool folded, float* partials) {
  const int64_t d = a.d, ng = w.g1 - w.g0;
  if (w.part >= 0) {
    float* p = partials + partial_at(w.slot, a.hq, d);
    for (int64_t g = 0; g < ng; ++g, p += d + 2) {
      std::copy(t.acc + g * d, t.acc + (g + 1) * d, p);
      p[d] = t.m[g];
      p[d + 1] = t.l[g];
    }
    return;
  }
  if (folded) fold_partition(t, w.rows * ng, d, false);
  const float* l = folded ? t.tl : t.l;
  const float* acc = folded ? t.tacc : t.acc;
  for (int64_t r = 0; r < w.rows; ++r) {
    const int64_t tok = a.qsl[w.seq] + w.row0 + r;
    for (int64_t g = w.g0; g < w.g1; ++g) {
      const int64_t st = r * ng + (g - w.g0);
      write_state(a.out + tok * a.out_stride + g * d, l[st], acc + st * d, d);
    }
  }
}

// Where item w's kv head's key (and value) tile of its sequence's block blk starts, in elements.
template <typename T>
inline int64_t tile_offset(const AttnArgs<T>& a, const AttnItem& w, int64_t blk) {
  return (static_cast<int64_t>(a.block_tables[w.seq * a.max_blocks + blk]) * a.hk + w.kv_head) * a.bs * a.d;
}

// Fetches into L2 at once the lines of block blk's key and value tiles that an item reading keys
// up to last_pos reads (keys are stored transposed: a partly filled block's keys are the first n
// of each row). Blocks sit anywhere in the cache, so the hardware prefetchers, which follow streams
// within a page, cannot fetch the next one ahead.
template <typename T>
inline void fetch_block(const AttnArgs<T>& a, const AttnItem& w, int64_t blk, int64_t last_pos) {
  const int64_t tile = tile_offset(a, w, blk);
  const int64_t n = std::min<int64_t>(a.bs, last_pos + 1 - blk * a.bs), sz = sizeof(T);
  const int64_t per = kPairedCache<T> ? 2 : 1;  // a paired tile: d / 2 rows of pairs, keys in pairs
  const int64_t rows = n == a.bs ? 1 : a.d / per, row_bytes = n == a.bs ? a.d * a.bs * sz : per * n * sz;
  const char* k = reinterpret_cast<const char*>(a.k_cache + tile);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; b += 64) prefetch_l2(k + r * per * a.bs * sz + b);
  const char* v = reinterpret_cast<const char*>(a.v_cache + tile);
  for (int64_t b = 0; b < (n + per - 1) / per * per * a.d * sz; b += 64) prefetch_l2(v + b);
}

// Fetches the blocks a thread reads after those before block `from` of item w: w's [from, to), or
// the first of `next` where w has none left.
template <typename T>
inline void fetch_after(const AttnArgs<T>& a, const AttnItem& w, const ItemSpan& sp, int64_t from, int64_t to,
                        const AttnItem* next) {
  if (from < sp.end_blk) {
    for (int64_t blk = from; blk < to; ++blk) fetch_block(a, w, blk, sp.last_pos);
    return;
  }
  if (next == nullptr) return;
  const ItemSpan nx = ItemSpan::of(a, *next);
  fetch_block(a, *next, nx.first_blk, nx.last_pos);
}

// Whether an item of n_rows (row, head) pairs on `path` fetches the block it reads next at once
// before each block (fetch_after), a decode's also the first block of the item its thread takes
// next (an item claimed ahead: claims_ahead), or leaves the reads to the hardware's prefetchers.
// Each tile is read in order within its pages, row after row (kDecodeKB), so they follow it.
// - Decode items on the vector paths: no. Paced a few lines per micro-kernel step, the fetches
//   made decode attention slower where the cache came from memory and from the L3 alike (AMD EPYC
//   Zen 5, 2 threads, 30 layers' caches in turn, old and new in one binary taking turns, medians
//   of 9; blocks shuffled): 64 sequences of 200 tokens bfloat16 0.86-0.87x the time, float32
//   0.86-0.89x, 4 of 1,000 0.83-0.89x, 1 of 1,000 0.83-0.85x, 16 of 400 0.82-0.85x; one layer's
//   cache (in the L3) 0.75x. One line of each 4 KB page of the next block at once (its page's
//   translation and stream started) was level with none (0.95-1.03x, three quiet runs).
// - Prefill items on the vector paths: blocks of up to 32 KB (bfloat16, float8) yes, float32's 64
//   KB no: 2,048 tokens float32 0.92-0.95x the time without, 6,144 0.93x; bfloat16 0.99-1.01x
//   at 2,048 and 4,096 tokens, 1.00-1.06x at 6,144 (kept).
// - AMX tiles read a block in a few instructions, strided: decode items (up to one tile of rows)
//   yes (as before; not measured again, the Zen 5 VM has no AMX), prefill items no (a 2,048-token
//   prefill's attention 0.95x the time without, 6,144 tokens 0.84-0.92x).
template <typename T>
inline bool fetches_ahead(const AttnArgs<T>& a, AttnPath path, int64_t n_rows) {
  if (path == AttnPath::amx) return n_rows <= 16;
  return !few_rows(n_rows) && 2 * a.d * a.bs * static_cast<int64_t>(sizeof(T)) <= 32768;
}
inline bool claims_ahead(AttnPath path, int64_t n_rows) { return path == AttnPath::amx && few_rows(n_rows); }

// Keys an online softmax step on AMX tiles takes: whole blocks, as many as fit (up to
// kAmxStepBlocks, the partition's blocks a whole number of steps), where every other path takes one
// block a step. Its turns between tile and vector code, its accumulators' loads and stores and its
// softmax's reductions come once a step. The Xeon with AMX, old and new in one binary taking turns,
// medians of 11, two threads: 512-key steps against one block of 128 (the engine's block size), a
// 2,048-token prefill's attention 0.79-0.82x the time (one thread 0.79x), 512 tokens 0.89x, 6,144
// 0.84x; decode 64 sequences of 200 tokens 0.90x, 16 of 400 0.82x, 1 of 7,500 0.79x. (Blocks of 256
// keys as a proxy: 0.92x; of 1,024: no better than 512. On the pair path, no turns to save, 512-key
// blocks 0.97-0.99x: it keeps one block a step.)
constexpr int64_t kAmxStepKeys = 512;
inline int64_t amx_step_blocks(int64_t bs) {
  const int64_t pb = partition_blocks(bs);
  int64_t g = std::clamp<int64_t>(kAmxStepKeys / bs, 1, std::min(pb, kAmxStepBlocks));
  while (pb % g) --g;
  return g;
}

// The end of the step that starts at block blk (of a sequence's blocks [.., end_blk)): steps of
// `per` blocks counted from each partition's first, so that a row's steps depend only on its
// position, whatever the item, the prefill's chunking or the batch that brings it.
inline int64_t step_end(int64_t blk, int64_t end_blk, int64_t pb, int64_t per) {
  const int64_t p0 = blk / pb * pb;
  return std::min({end_blk, p0 + pb, p0 + ((blk - p0) / per + 1) * per});
}

// The blocks [blk, end) of work item w through one step on tiles (attend_step_amx).
template <typename T>
inline void attend_amx_step(const AttnArgs<T>& a, const TileScratch& t, const AttnItem& w, const ItemSpan& sp,
                            int64_t blk, int64_t end) {
#ifdef __AMX_BF16__
  if constexpr (std::is_same_v<T, bf16>) {
    AmxStep st;
    st.n = end - blk;
    for (int64_t g = 0; g < st.n; ++g) {
      st.kt[g] = a.k_cache + tile_offset(a, w, blk + g);
      st.vt[g] = a.v_cache + tile_offset(a, w, blk + g);
    }
    AttnShape ws = a;
    ws.bs = st.n * a.bs;
    attend_step_amx(a, t, BlockView::at(w.rows, w.g1 - w.g0, sp.first_pos, blk * a.bs, ws), st);
  }
#endif
}

// One work item: its rows and heads through the sequence's blocks in order, a step a block (AMX
// tiles: several, amx_step_blocks), each partition merged into the total at its end (a partition
// item: its partition's), the blocks after each step fetched where fetches_ahead says (`next`: the
// item this thread takes next, if claimed).
template <typename T>
inline void attend_item(const AttnArgs<T>& a, const AttnItem& w, const AttnItem* next, const TileScratch& t,
                        AttnPath path, float* partials) {
  const ItemSpan sp = ItemSpan::of(a, w);
  const int64_t pb = partition_blocks(a.bs), per = path == AttnPath::amx ? amx_step_blocks(a.bs) : 1;
  const bool fetch = fetches_ahead(a, path, w.rows * (w.g1 - w.g0));
  start_tile(a, w, t, path);
  bool folded = false;
  for (int64_t blk = sp.first_blk, end; blk < sp.end_blk; blk = end) {
    end = step_end(blk, sp.end_blk, pb, per);
    if (blk > sp.first_blk && blk % pb == 0) {
      fold_partition(t, w.rows * (w.g1 - w.g0), a.d, !folded);
      folded = true;
    }
    if (fetch) fetch_after(a, w, sp, end, end < sp.end_blk ? step_end(end, sp.end_blk, pb, per) : end, next);
    if (path == AttnPath::amx) {
      attend_amx_step(a, t, w, sp, blk, end);
      continue;
    }
    if (w.nkv > 1) {
      if (blk + 1 < sp.end_blk) fetch_pages(a.k_cache + tile_offset(a, w, blk + 1), w.nkv * a.bs * a.d);
      attend_whole_block(a, t, w, BlockView::at(1, a.group, sp.first_pos, blk * a.bs, a), tile_offset(a, w, blk), path);
      continue;
    }
    const BlockView b = BlockView::at(w.rows, w.g1 - w.g0, sp.first_pos, blk * a.bs, a);
    attend_tile_block(a, t, b, tile_offset(a, w, blk), path);
  }
  finish_tile(a, w, t, folded, partials);
}

// The path of a call (see AttnPath). bfloat16 caches on CPUs with AVX-512 BF16: bfloat16 pair dot
// products (vdpbf16ps), or AMX tiles where the CPU has them, the queries and the probabilities
// rounded to bfloat16 (as torch's bfloat16 attention computes them), at twice the FMA path's rate
// or more. Tiles take 32 keys or 32 head elements a step: other shapes keep the pair path.
template <typename T>
inline AttnPath attention_path(const AttnArgs<T>& a) {
  if (!kWidenInRegisters<T> || a.k_scale != 1.f || a.v_scale != 1.f) return AttnPath::widen;
  if (!std::is_same_v<T, bf16> || !kBf16PairAttention || a.d % VecF::N) return AttnPath::direct;
  return kAmxAttention && a.d % 32 == 0 && a.bs % kAmxKeys == 0 ? AttnPath::amx : AttnPath::pairs;
}

// The partition items' states merged per (row, head), in partition order, into the output: the
// merge_state and write_state of an item that walks all the partitions itself (finish_tile).
template <typename T>
inline void merge_partitions(const AttnArgs<T>& a, const std::vector<AttnItem>& items, const float* partials) {
  const int64_t d = a.d;
  static thread_local std::vector<float> tacc;
  tacc.resize(static_cast<size_t>(d));
  for (size_t i = 0; i < items.size();) {
    const AttnItem& w = items[i];
    if (w.part < 0) {
      ++i;
      continue;
    }
    size_t j = i;  // [i, j): the partitions of w's (sequence, kv head), in order
    while (j < items.size() && items[j].part >= 0 && items[j].seq == w.seq && items[j].kv_head == w.kv_head &&
           items[j].nkv == w.nkv)
      ++j;
    const int64_t tok = a.qsl[w.seq] + w.row0;
    for (int64_t g = 0; g < w.g1 - w.g0; ++g) {
      const float* p = partials + partial_at(items[i].slot, a.hq, d) + g * (d + 2);
      float tm = p[d], tl = p[d + 1];
      std::copy(p, p + d, tacc.begin());
      for (size_t k = i + 1; k < j; ++k) {
        p = partials + partial_at(items[k].slot, a.hq, d) + g * (d + 2);
        merge_state(tm, tl, tacc.data(), p[d], p[d + 1], p, d);
      }
      write_state(a.out + tok * a.out_stride + (w.g0 + g) * d, tl, tacc.data(), d);
    }
    i = j;
  }
}

template <typename T>
void paged_attention_t(const AttnArgs<T>& a) {
  const AttnPath path = attention_path(a);
  int32_t slots = 0;
  const std::vector<AttnItem>& items = attention_items(a, path, slots);
  // the keys a step takes: the rows of its scores and probabilities (TileScratch)
  const int64_t step_keys = (path == AttnPath::amx ? amx_step_blocks(a.bs) : 1) * a.bs;
  const int64_t n_items = static_cast<int64_t>(items.size());
  const AttnItem* item_ptr = items.data();
  static thread_local LineVector<float> partial_buf;
  if (partial_buf.size() < static_cast<size_t>(slots * a.hq * (a.d + 2)))
    partial_buf.resize(static_cast<size_t>(slots * a.hq * (a.d + 2)));
  float* partials = partial_buf.data();
  // Items are taken one at a time (their costs differ with their contexts). A thread claims its
  // next item before it starts a decode item on tiles, so that it can fetch that item's first
  // block; other items are claimed only when their turn comes (a prefill's held ones left a thread
  // idle at its costliest end: a 2,048-token prefill's attention +4%).
  std::atomic<int64_t> claimed{0};
#pragma omp parallel
  {
    const TileScratch t = TileScratch::for_this_thread(a.hq, a.d, step_keys);
    auto claim = [&] { return claimed.fetch_add(1, std::memory_order_relaxed); };
    for (int64_t it = claim(); it < n_items;) {
      const AttnItem& w = item_ptr[it];
      const int64_t nx = claims_ahead(path, w.rows * (w.g1 - w.g0)) ? claim() : -1;
      attend_item(a, w, nx >= 0 && nx < n_items ? item_ptr + nx : nullptr, t, path, partials);
      it = nx >= 0 ? nx : claim();
    }
#ifdef __AMX_BF16__
    if (*t.tiles) {  // configured by the call's first block on tiles, released after its last
      _tile_release();
      *t.tiles = 0;
    }
#endif
  }
  if (slots > 0) merge_partitions(a, items, partials);
}

void paged_attention_impl(float* out, const float* q, const void* k_cache, const void* v_cache,
                          DType dt, const int32_t* block_tables, int64_t max_blocks,
                          const int32_t* seq_lens, const int32_t* qsl, int64_t num_seqs, int64_t hq,
                          int64_t hk, int64_t group, int64_t q_off, int64_t d, int64_t bs, float scale,
                          int64_t window, float softcap, int64_t q_stride, int64_t out_stride, float k_scale,
                          float v_scale) {
  with_cache_type(dt, [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    paged_attention_t(AttnArgs<T>{{d, bs, window, scale, softcap}, out, q, static_cast<const T*>(k_cache),
                                  static_cast<const T*>(v_cache), block_tables, seq_lens, qsl, max_blocks, num_seqs,
                                  hq, hk, group, q_off, q_stride, out_stride, k_scale, v_scale});
  });
}

}  // namespace
}  // namespace cpuserve
