// Paged attention for mixed batches: every sequence brings q_len query tokens
// (a prefill chunk, or 1 for decode) that are the last q_len positions of its
// context; keys and values come from the paged cache through its block table.
//
// Work item = (sequence, kv head, tile of up to kQTile query rows). The item walks
// the sequence's blocks in order; all query heads of the kv group and all rows of
// the tile share each loaded key/value tile. Each (row, head) keeps an online
// softmax (running max m, sum l, accumulator acc[D]) updated block by block, so
// a row's result depends only on its position and its context: not on the tile,
// the chunking of the prefill, the batch or the thread count.
#pragma once
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>
#include <omp.h>
#include "../vec/vec.hpp"

namespace cpuserve {
namespace {

constexpr int64_t kQTile = 16;
#ifdef __AVX512BF16__
constexpr bool kBf16PairAttention = true;
#else
constexpr bool kBf16PairAttention = false;
#endif

// Rows [row0, row0 + rows) of one sequence, query heads [g0, g1) of kv head kv_head's group.
struct AttnItem { int32_t seq, kv_head, row0, rows, g0, g1; };

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
// key vectors, value accumulators of R rows x V vectors.
constexpr int kScoreQB = VecF::kRegs >= 32 ? 6 : 4;
constexpr int kScoreKB = VecF::kRegs >= 32 ? 4 : 2;
constexpr int kValueR = VecF::kRegs >= 32 ? 6 : 2;
constexpr int kValueV = 4;

// Where the micro-kernels read a block's keys (row e, column j: kt[e * bs + j]) or values (row j,
// column e: v[j * d + e]): Rows<T> widens T in registers (bf16x2: pairs already laid out);
// PairRows pairs rows (2r, 2r + 1) of a bfloat16 tile in registers, a row outside [lo, hi]
// reading as zeros.
template <typename T> struct Rows {
  using Elem = T;
  const T* p;
  int64_t stride;
  VecF at(int64_t row, int64_t col) const { return VecF::load(p + row * stride + col); }
  Rows shift(int64_t rows) const { return {p + rows * stride, stride}; }
};
#ifdef __AVX512BF16__
struct PairRows {
  using Elem = bf16x2;
  const bf16* p;
  int64_t stride, lo, hi;
  VecF at(int64_t row, int64_t col) const {
    const int64_t r = 2 * row;
    return VecF::pairs(r >= lo ? p + r * stride + col : nullptr, r + 1 <= hi ? p + (r + 1) * stride + col : nullptr);
  }
  PairRows shift(int64_t rows) const { return {p + 2 * rows * stride, stride, lo - 2 * rows, hi - 2 * rows}; }
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

// s[i * bs + j] = q_i . k_j for the nq query vectors and the key vectors [c_lo, c_hi] of a block.
template <typename Src>
inline void block_scores(const AOf<typename Src::Elem>* const* qs, int64_t nq, const Src& kt, int64_t bs, int64_t d,
                         int64_t c_lo, int64_t c_hi, float* s) {
  // key vectors outer: their d x KB slab stays in L1 while every query vector passes over it
  for (int64_t c = c_lo; c <= c_hi; c += kScoreKB) {
    const int kb = static_cast<int>(std::min<int64_t>(kScoreKB, c_hi - c + 1));
    for (int64_t i = 0; i < nq; i += kScoreQB)
      scores_tile<Src, kScoreQB, kScoreKB>(static_cast<int>(std::min<int64_t>(kScoreQB, nq - i)), kb, qs + i, kt, bs,
                                           d, c, s + i * bs);
  }
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

// acc_i[0:d] += sum_j p_i[j] * v[j, 0:d] for the rows i < rows (acc + i * d, p + i * ps) over
// the n keys of v: the same chains whatever the number of rows taken together.
template <typename Src>
inline void accumulate_values(float* acc, const AOf<typename Src::Elem>* p, int64_t ps, int64_t rows, const Src& v,
                              int64_t n, int64_t d) {
  const int64_t nvec = d / VecF::N;
  for (int64_t i = 0; i < rows; i += kValueR)
    for (int64_t c = 0; c < nvec; c += kValueV)
      values_tile<Src, kValueR, kValueV>(static_cast<int>(std::min<int64_t>(kValueR, rows - i)),
                                         static_cast<int>(std::min<int64_t>(kValueV, nvec - c)), acc + i * d,
                                         p + i * ps, ps, v, n, d, c * VecF::N);
  if constexpr (!std::is_same_v<typename Src::Elem, bf16x2>) {  // (the pair path runs only when N divides d)
    for (int64_t e = nvec * VecF::N; e < d; ++e)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < n; ++j)
          acc[i * d + e] = std::fma(p[i * ps + j], to_float(v.p[j * d + e]), acc[i * d + e]);
  }
}

// One block's step of a row's online softmax: p[0, n) holds the raw scores of the keys the row
// sees in the block and becomes their probabilities exp(s * scale - m_new); the running max *m and
// sum *l move on, and the accumulator acc[0, d) is rescaled for the new max. Vector steps in
// fixed chunks of the key index from the row's first key in the block, which depends only on the
// row's position: a row gets the same bits on every path.
inline void online_softmax(float* p, int64_t n, float scale, float softcap, float* m, float* l, float* acc,
                           int64_t d) {
  float blk_max = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  if (softcap > 0.f) {
    for (; j < n; ++j) {
      p[j] = softcap * std::tanh(p[j] * scale / softcap);
      blk_max = std::max(blk_max, p[j]);
    }
  } else {
    const VecF vs = VecF::set1(scale);
    VecF vm = VecF::set1(blk_max);
    for (; j + VecF::N <= n; j += VecF::N) {
      const VecF x = VecF::load(p + j) * vs;
      x.store(p + j);
      vm = VecF::max(vm, x);
    }
    blk_max = vm.reduce_max();
    for (; j < n; ++j) {
      p[j] = p[j] * scale;
      blk_max = std::max(blk_max, p[j]);
    }
  }
  const float m_new = std::max(*m, blk_max);
  const float alpha = std::exp(*m - m_new);  // exp(-inf) = 0 on the first block
  const VecF vmax = VecF::set1(m_new);
  VecF vsum = VecF::zero();
  for (j = 0; j + VecF::N <= n; j += VecF::N) {
    const VecF e = (VecF::load(p + j) - vmax).exp();
    e.store(p + j);
    vsum = vsum + e;
  }
  float psum = vsum.reduce_sum();
  for (; j < n; ++j) {
    p[j] = std::exp(p[j] - m_new);
    psum += p[j];
  }
  *l = *l * alpha + psum;
  *m = m_new;
  if (alpha != 1.f) {
    const VecF va = VecF::set1(alpha);
    int64_t e = 0;
    for (; e + VecF::N <= d; e += VecF::N) (VecF::load(acc + e) * va).store(acc + e);
    for (; e < d; ++e) acc[e] *= alpha;
  }
}

// Asks for the next block's key and value tiles while this one is worked on: blocks sit anywhere
// in the cache, so the hardware prefetchers, which follow streams within a page, cannot.
template <typename T>
inline void prefetch_tile(const T* k_cache, const T* v_cache, int64_t tile, int64_t n) {
  const char* kp = reinterpret_cast<const char*>(k_cache + tile);
  const char* vp = reinterpret_cast<const char*>(v_cache + tile);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < bytes; o += 64) {
    __builtin_prefetch(kp + o);
    __builtin_prefetch(vp + o);
  }
}

template <typename T>
void paged_attention_t(float* out, const float* q, const T* k_cache, const T* v_cache,
                       const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_lens,
                       const int32_t* qsl, int64_t num_seqs, int64_t hq, int64_t hk, int64_t group,
                       int64_t q_off, int64_t d, int64_t bs, float scale, int64_t window, float softcap,
                       int64_t q_stride, int64_t out_stride, float k_scale, float v_scale) {
  // float, bfloat16 and float16 tiles are widened in registers by the micro-kernels; float8 or
  // scaled tiles are widened once per block into float buffers.
  constexpr bool kWidenInRegisters = std::is_same<T, float>::value || std::is_same<T, bf16>::value ||
                                     std::is_same<T, f16>::value;
  const bool direct = kWidenInRegisters && k_scale == 1.f && v_scale == 1.f;
  // bfloat16 caches on CPUs with AVX-512 BF16: bfloat16 pair dot products (vdpbf16ps), the
  // queries and the probabilities rounded to bfloat16 (as torch's bfloat16 attention computes
  // them), at twice the FMA path's rate.
  constexpr bool kPairs = kBf16PairAttention && std::is_same_v<T, bf16>;
  const bool pairs = kPairs && direct && d % VecF::N == 0;
  // Local query head i attends with kv head (i + q_off) / group: with q_off = 0 and
  // hq = hk * group this is plain GQA; a tensor-parallel rank holding part of a
  // group passes where its first query head sits inside its first kv head's group.
  // The work list is rebuilt per call but reuses its storage: no allocation once warm.
  // Splitting decode rows per query head re-reads each key/value tile `group`
  // times, so it is done only when whole groups would leave threads idle.
  int64_t group_items = 0;
  for (int64_t s = 0; s < num_seqs; ++s) group_items += (qsl[s + 1] - qsl[s] + kQTile - 1) / kQTile * hk;
  const bool split_heads = group > 1 && group_items < 4 * static_cast<int64_t>(omp_get_max_threads());
  static thread_local std::vector<AttnItem> items;
  items.clear();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = qsl[s + 1] - qsl[s];
    for (int32_t r = 0; r < q_len; r += kQTile)
      for (int32_t h = 0; h < hk; ++h) {
        const int32_t rows = std::min<int32_t>(kQTile, q_len - r);
        // this kv head's query heads, as local indices
        const int32_t ga = static_cast<int32_t>(std::max<int64_t>(0, h * group - q_off));
        const int32_t gb = static_cast<int32_t>(std::min<int64_t>(hq, (h + 1) * group - q_off));
        if (ga >= gb) continue;
        if (q_len == 1 && split_heads) {
          for (int32_t g = ga; g < gb; ++g) items.push_back({static_cast<int32_t>(s), h, r, rows, g, g + 1});
        } else {
          items.push_back({static_cast<int32_t>(s), h, r, rows, ga, gb});
        }
      }
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  const AttnItem* item_ptr = items.data();

#pragma omp parallel
  {
    // Per-thread scratch, sized once for the largest shape seen.
    static thread_local std::vector<float> scratch;
    static thread_local std::vector<const float*> qptr;
    static thread_local std::vector<const bf16x2*> qpair;
    const size_t need = static_cast<size_t>(kQTile * group * (d + 2 + bs) + 2 * bs * d + kQTile * group * (d + bs) / 2);
    if (scratch.size() < need) scratch.resize(need);
    if (qptr.size() < static_cast<size_t>(kQTile * group)) qptr.resize(static_cast<size_t>(kQTile * group));
    if (qpair.size() < qptr.size()) qpair.resize(qptr.size());
    float* acc = scratch.data();                 // [rows][group][d]
    float* m = acc + kQTile * group * d;         // [rows][group]
    float* l = m + kQTile * group;               // [rows][group]
    float* sblk = l + kQTile * group;            // [rows][group][bs] a block's scores, then probabilities
    float* kbuf = sblk + kQTile * group * bs;    // [d][bs] keys as float (float8 or scaled caches)
    float* vbuf = kbuf + bs * d;                 // [bs][d] values as float
    // the pair path: keys as pairs (e, e + 1) [d/2][bs] in kbuf, values as pairs (j, j + 1)
    // [bs/2][d] in vbuf, queries [rows][group][d] and probabilities [rows][group][bs] in bfloat16
    bf16* qb = reinterpret_cast<bf16*>(vbuf + bs * d);
    bf16* pb = qb + kQTile * group * d;

#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const AttnItem w = item_ptr[it];
      const int64_t ctx = seq_lens[w.seq];
      const int64_t q_len = qsl[w.seq + 1] - qsl[w.seq];
      const int64_t first_pos = ctx - q_len + w.row0;  // position of the tile's first row
      const int64_t last_pos = first_pos + w.rows - 1;
      const int64_t lo_key = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      const int32_t* table = block_tables + w.seq * max_blocks;
      const int64_t ng = w.g1 - w.g0;

      for (int64_t i = 0; i < w.rows * ng; ++i) {
        m[i] = -std::numeric_limits<float>::infinity();
        l[i] = 0.f;
        std::fill(acc + i * d, acc + (i + 1) * d, 0.f);
      }
      for (int64_t r = 0; r < w.rows; ++r)
        for (int64_t g = w.g0; g < w.g1; ++g)
          qptr[r * ng + (g - w.g0)] = q + (qsl[w.seq] + w.row0 + r) * q_stride + g * d;
#ifdef __AVX512BF16__
      if (pairs)
        for (int64_t i = 0; i < w.rows * ng; ++i)
          for (int64_t e = 0; e < d; e += VecF::N) VecF::load(qptr[i] + e).store_bf16(qb + i * d + e);
#endif
      // One block on the pair path: keys and values paired once per block (a pair partner outside
      // the tile's keys is zero: its probability is zero for every row), then the same steps.
      auto attend_pairs = [&](const bf16* kt, const bf16* vt, int64_t base, int64_t blk_lo, int64_t blk_hi,
                              int64_t c_lo, int64_t c_hi, bool whole) {
#ifdef __AVX512BF16__
        {
          const int64_t d2 = d / 2, b2 = bs / 2;
          const PairRows kpairs{kt, bs, 0, d - 1}, vpairs{vt, d, blk_lo, blk_hi};
          const bf16x2* pp = reinterpret_cast<const bf16x2*>(pb);  // [rows][group][bs / 2]
          for (int64_t i = 0; i < w.rows * ng; ++i) qpair[i] = reinterpret_cast<const bf16x2*>(qb + i * d);
          // Tiles of many rows pair the block once (kbuf, vbuf); a decode's few rows pair it in
          // registers as they go. The same pairs either way, so the same bits.
          const bool pack = w.rows * ng > kScoreQB;
          const Rows<bf16x2> kp{reinterpret_cast<const bf16x2*>(kbuf), bs}, vp{reinterpret_cast<const bf16x2*>(vbuf), d};
          if (pack) {
            for (int64_t e = 0; e < d2; ++e)
              for (int64_t c = c_lo; c <= c_hi; ++c) kpairs.at(e, c * VecF::N).store(kbuf + e * bs + c * VecF::N);
            for (int64_t j = blk_lo / 2; j <= blk_hi / 2; ++j)
              for (int64_t e = 0; e < d; e += VecF::N) vpairs.at(j, e).store(vbuf + j * d + e);
            block_scores(qpair.data(), w.rows * ng, kp, bs, d2, c_lo, c_hi, sblk);
          } else {
            block_scores(qpair.data(), w.rows * ng, kpairs, bs, d2, c_lo, c_hi, sblk);
          }
          for (int64_t r = 0; r < w.rows; ++r) {
            const int64_t pos = first_pos + r;
            const int64_t k_lo = std::max<int64_t>(base, window > 0 ? pos - window + 1 : 0) - base;
            const int64_t k_hi = std::min<int64_t>(base + bs - 1, pos) - base;  // inclusive
            if (k_lo > k_hi) continue;
            for (int64_t g = 0; g < ng; ++g) {
              float* sp = sblk + (r * ng + g) * bs;
              online_softmax(sp + k_lo, k_hi - k_lo + 1, scale, softcap, m + r * ng + g, l + r * ng + g,
                             acc + (r * ng + g) * d, d);
              // the row's probabilities as bfloat16 pairs over its whole pairs, zero outside its keys
              if (k_lo % 2) sp[k_lo - 1] = 0.f;
              if (k_hi % 2 == 0) sp[k_hi + 1] = 0.f;
              for (int64_t j = k_lo / VecF::N * VecF::N; j <= k_hi; j += VecF::N)
                VecF::load(sp + j).store_bf16(pb + (r * ng + g) * bs + j);
            }
            if (whole) continue;
            const int64_t j0 = k_lo / 2, nj = k_hi / 2 - k_lo / 2 + 1;
            if (pack) accumulate_values(acc + r * ng * d, pp + r * ng * b2 + j0, b2, ng, vp.shift(j0), nj, d);
            else accumulate_values(acc + r * ng * d, pp + r * ng * b2 + j0, b2, ng, vpairs.shift(j0), nj, d);
          }
          if (whole && pack) accumulate_values(acc, pp, b2, w.rows * ng, vp, b2, d);
          if (whole && !pack) accumulate_values(acc, pp, b2, w.rows * ng, vpairs, b2, d);
        }
#endif
      };
      for (int64_t b = lo_key / bs; b * bs <= last_pos; ++b) {
        const int64_t tile = (static_cast<int64_t>(table[b]) * hk + w.kv_head) * bs * d;
        const int64_t base = b * bs;
        // keys this tile's rows can see in this block, and the key vectors holding them
        const int64_t blk_lo = std::max<int64_t>(base, window > 0 ? first_pos - window + 1 : 0) - base;
        const int64_t blk_hi = std::min<int64_t>(base + bs - 1, last_pos) - base;  // inclusive
        const int64_t c_lo = blk_lo / VecF::N, c_hi = blk_hi / VecF::N;
        if ((b + 1) * bs <= last_pos)
          prefetch_tile(k_cache, v_cache, (static_cast<int64_t>(table[b + 1]) * hk + w.kv_head) * bs * d, bs * d);
        // Every row of the tile sees the whole block: its values are accumulated for all rows
        // and heads at once (the same chains as row by row).
        const bool whole = first_pos >= base + bs - 1 && (window <= 0 || last_pos - window + 1 <= base);
        auto attend = [&](const auto* kt, const auto* vb) {
          using E = std::remove_cv_t<std::remove_pointer_t<decltype(kt)>>;
          block_scores(qptr.data(), w.rows * ng, Rows<E>{kt, bs}, bs, d, c_lo, c_hi, sblk);
          for (int64_t r = 0; r < w.rows; ++r) {
            const int64_t pos = first_pos + r;
            const int64_t k_lo = std::max<int64_t>(base, window > 0 ? pos - window + 1 : 0);
            const int64_t k_hi = std::min<int64_t>(base + bs - 1, pos);  // inclusive
            if (k_lo > k_hi) continue;
            const int64_t n = k_hi - k_lo + 1;
            for (int64_t g = 0; g < ng; ++g) online_softmax(sblk + (r * ng + g) * bs + (k_lo - base), n, scale, softcap,
                                                            m + r * ng + g, l + r * ng + g, acc + (r * ng + g) * d, d);
            if (!whole) accumulate_values(acc + r * ng * d, sblk + r * ng * bs + (k_lo - base), bs, ng,
                                          Rows<E>{vb + (k_lo - base) * d, d}, n, d);
          }
          if (whole) accumulate_values(acc, sblk, bs, w.rows * ng, Rows<E>{vb, d}, bs, d);
        };
        if constexpr (kPairs) {
          if (pairs) {
            attend_pairs(reinterpret_cast<const bf16*>(k_cache + tile), reinterpret_cast<const bf16*>(v_cache + tile),
                         base, blk_lo, blk_hi, c_lo, c_hi, whole);
            continue;
          }
        }
        if constexpr (kWidenInRegisters) {
          if (direct) {
            attend(k_cache + tile, v_cache + tile);
            continue;
          }
        }
        {  // float8, or scaled: widened to float once per block
          for (int64_t e = 0; e < d; ++e)
            convert_to_float(kbuf + e * bs + c_lo * VecF::N, k_cache + tile + e * bs + c_lo * VecF::N,
                             (c_hi - c_lo + 1) * VecF::N, k_scale);
          convert_to_float(vbuf + blk_lo * d, v_cache + tile + blk_lo * d, (blk_hi - blk_lo + 1) * d, v_scale);
          attend(static_cast<const float*>(kbuf), static_cast<const float*>(vbuf));
        }
      }
      for (int64_t r = 0; r < w.rows; ++r) {
        const int64_t tok = qsl[w.seq] + w.row0 + r;
        for (int64_t g = w.g0; g < w.g1; ++g) {
          const int64_t st = r * ng + (g - w.g0);
          const float inv = l[st] > 0.f ? 1.f / l[st] : 0.f;
          float* o = out + tok * out_stride + g * d;
          const float* a = acc + st * d;
          for (int64_t e = 0; e < d; ++e) o[e] = a[e] * inv;
        }
      }
    }
  }
}

void paged_attention_impl(float* out, const float* q, const void* k_cache, const void* v_cache,
                          DType dt, const int32_t* block_tables, int64_t max_blocks,
                          const int32_t* seq_lens, const int32_t* qsl, int64_t num_seqs, int64_t hq,
                          int64_t hk, int64_t group, int64_t q_off, int64_t d, int64_t bs, float scale,
                          int64_t window, float softcap, int64_t q_stride, int64_t out_stride, float k_scale,
                          float v_scale) {
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    paged_attention_t(out, q, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), block_tables,
                      max_blocks, seq_lens, qsl, num_seqs, hq, hk, group, q_off, d, bs, scale, window, softcap,
                      q_stride, out_stride, k_scale, v_scale);
  };
  switch (dt) {
    case DType::F32: return run(static_cast<float*>(nullptr));
    case DType::BF16: return run(static_cast<bf16*>(nullptr));
    case DType::F16: return run(static_cast<f16*>(nullptr));
    case DType::F8E5M2: return run(static_cast<f8e5m2*>(nullptr));
    case DType::F8E4M3: return run(static_cast<f8e4m3*>(nullptr));
  }
}

}  // namespace
}  // namespace cpuserve
