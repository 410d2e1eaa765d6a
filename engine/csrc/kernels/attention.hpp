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

// Scores of query vectors qs[0, QB) against key vectors [c, c + KB) of a block whose keys are
// stored transposed (kt[e * bs + j]): each score is one FMA chain over e = 0..d-1 from zero, so
// its bits do not depend on the blocking, the tile or the path (decode or prefill).
template <int QB, int KB>
inline void scores_micro(const float* const* qs, const float* kt, int64_t bs, int64_t d, int64_t c, float* s) {
  VecF acc[QB][KB];
  for (int i = 0; i < QB; ++i)
    for (int j = 0; j < KB; ++j) acc[i][j] = VecF::zero();
  const float* kc = kt + c * VecF::N;
  for (int64_t e = 0; e < d; ++e) {
    VecF k[KB];
    for (int j = 0; j < KB; ++j) k[j] = VecF::load(kc + e * bs + j * VecF::N);
    for (int i = 0; i < QB; ++i) {
      const VecF qe = VecF::set1(qs[i][e]);
      for (int j = 0; j < KB; ++j) acc[i][j] = VecF::fma(qe, k[j], acc[i][j]);
    }
  }
  for (int i = 0; i < QB; ++i)
    for (int j = 0; j < KB; ++j) acc[i][j].store(s + i * bs + (c + j) * VecF::N);
}

// s[i * bs + j] = q_i . k_j for the nq query vectors and the key vectors [c_lo, c_hi] of a block.
inline void block_scores(const float* const* qs, int64_t nq, const float* kt, int64_t bs, int64_t d, int64_t c_lo,
                         int64_t c_hi, float* s) {
  for (int64_t i = 0; i < nq; i += 4) {
    const float* const* q = qs + i;
    float* si = s + i * bs;
    const int64_t qb = std::min<int64_t>(4, nq - i);
    for (int64_t c = c_lo; c <= c_hi; c += 2) {
      const bool two = c + 1 <= c_hi;
      switch (qb * 2 + (two ? 1 : 0)) {
        case 9: scores_micro<4, 2>(q, kt, bs, d, c, si); break;
        case 8: scores_micro<4, 1>(q, kt, bs, d, c, si); break;
        case 7: scores_micro<3, 2>(q, kt, bs, d, c, si); break;
        case 6: scores_micro<3, 1>(q, kt, bs, d, c, si); break;
        case 5: scores_micro<2, 2>(q, kt, bs, d, c, si); break;
        case 4: scores_micro<2, 1>(q, kt, bs, d, c, si); break;
        case 3: scores_micro<1, 2>(q, kt, bs, d, c, si); break;
        default: scores_micro<1, 1>(q, kt, bs, d, c, si); break;
      }
    }
  }
}

// acc[0:d] = sum_j p[j] * v[j, 0:d] on top of acc, one FMA chain per element in
// key order, with up to 8 vectors of the accumulator held in registers.
inline void accumulate_values(float* acc, const float* p, const float* v, int64_t n, int64_t d) {
  constexpr int kRegs = 8;
  const int64_t dv = d / VecF::N * VecF::N;
  for (int64_t e0 = 0; e0 < dv; e0 += kRegs * VecF::N) {
    const int nv = static_cast<int>(std::min<int64_t>(kRegs, (dv - e0) / VecF::N));
    VecF r[kRegs];
    for (int i = 0; i < nv; ++i) r[i] = VecF::load(acc + e0 + i * VecF::N);
    for (int64_t j = 0; j < n; ++j) {
      const VecF pj = VecF::set1(p[j]);
      const float* vr = v + j * d + e0;
      for (int i = 0; i < nv; ++i) r[i] = VecF::fma(pj, VecF::load(vr + i * VecF::N), r[i]);
    }
    for (int i = 0; i < nv; ++i) r[i].store(acc + e0 + i * VecF::N);
  }
  for (int64_t e = dv; e < d; ++e)
    for (int64_t j = 0; j < n; ++j) acc[e] = std::fma(p[j], v[j * d + e], acc[e]);
}

// accumulate_values for two accumulators over the same keys (two query heads of one row): the
// same chains, element by element, sharing each value load.
inline void accumulate_values2(float* acc0, const float* p0, float* acc1, const float* p1, const float* v, int64_t n,
                               int64_t d) {
  constexpr int kRegs = 4;
  const int64_t dv = d / VecF::N * VecF::N;
  for (int64_t e0 = 0; e0 < dv; e0 += kRegs * VecF::N) {
    const int nv = static_cast<int>(std::min<int64_t>(kRegs, (dv - e0) / VecF::N));
    VecF r0[kRegs], r1[kRegs];
    for (int i = 0; i < nv; ++i) {
      r0[i] = VecF::load(acc0 + e0 + i * VecF::N);
      r1[i] = VecF::load(acc1 + e0 + i * VecF::N);
    }
    for (int64_t j = 0; j < n; ++j) {
      const VecF a = VecF::set1(p0[j]), b = VecF::set1(p1[j]);
      const float* vr = v + j * d + e0;
      for (int i = 0; i < nv; ++i) {
        const VecF x = VecF::load(vr + i * VecF::N);
        r0[i] = VecF::fma(a, x, r0[i]);
        r1[i] = VecF::fma(b, x, r1[i]);
      }
    }
    for (int i = 0; i < nv; ++i) {
      r0[i].store(acc0 + e0 + i * VecF::N);
      r1[i].store(acc1 + e0 + i * VecF::N);
    }
  }
  for (int64_t e = dv; e < d; ++e)
    for (int64_t j = 0; j < n; ++j) {
      acc0[e] = std::fma(p0[j], v[j * d + e], acc0[e]);
      acc1[e] = std::fma(p1[j], v[j * d + e], acc1[e]);
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
  constexpr bool kConvert = !std::is_same<T, float>::value;
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
    const size_t need = static_cast<size_t>(kQTile * group * (d + 2 + bs) + group * bs + (kConvert ? 2 * bs * d : 0));
    if (scratch.size() < need) scratch.resize(need);
    if (qptr.size() < static_cast<size_t>(kQTile * group)) qptr.resize(static_cast<size_t>(kQTile * group));
    float* acc = scratch.data();                 // [rows][group][d]
    float* m = acc + kQTile * group * d;         // [rows][group]
    float* l = m + kQTile * group;               // [rows][group]
    float* sblk = l + kQTile * group;            // [rows][group][bs] a block's raw scores
    float* sc = sblk + kQTile * group * bs;      // [group][bs] one row's probabilities
    float* kbuf = sc + group * bs;               // [d][bs] keys as float (narrow caches)
    float* vbuf = kbuf + bs * d;                 // [bs][d] values as float

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
      for (int64_t b = lo_key / bs; b * bs <= last_pos; ++b) {
        const int64_t tile = (static_cast<int64_t>(table[b]) * hk + w.kv_head) * bs * d;
        const int64_t base = b * bs;
        // keys this tile's rows can see in this block, and the key vectors holding them
        const int64_t blk_lo = std::max<int64_t>(base, window > 0 ? first_pos - window + 1 : 0) - base;
        const int64_t blk_hi = std::min<int64_t>(base + bs - 1, last_pos) - base;  // inclusive
        const int64_t c_lo = blk_lo / VecF::N, c_hi = blk_hi / VecF::N;
        if ((b + 1) * bs <= last_pos)
          prefetch_tile(k_cache, v_cache, (static_cast<int64_t>(table[b + 1]) * hk + w.kv_head) * bs * d, bs * d);
        const float* kt;
        const float* vb;
        if constexpr (kConvert) {
          for (int64_t e = 0; e < d; ++e)
            convert_to_float(kbuf + e * bs + c_lo * VecF::N, k_cache + tile + e * bs + c_lo * VecF::N,
                             (c_hi - c_lo + 1) * VecF::N, k_scale);
          convert_to_float(vbuf + blk_lo * d, v_cache + tile + blk_lo * d, (blk_hi - blk_lo + 1) * d, v_scale);
          kt = kbuf;
          vb = vbuf;
        } else {
          kt = k_cache + tile;
          vb = v_cache + tile;
        }
        block_scores(qptr.data(), w.rows * ng, kt, bs, d, c_lo, c_hi, sblk);
        for (int64_t r = 0; r < w.rows; ++r) {
          const int64_t pos = first_pos + r;
          const int64_t k_lo = std::max<int64_t>(base, window > 0 ? pos - window + 1 : 0);
          const int64_t k_hi = std::min<int64_t>(base + bs - 1, pos);  // inclusive
          if (k_lo > k_hi) continue;
          const int64_t n = k_hi - k_lo + 1;
          for (int64_t g = 0; g < ng; ++g) {
            const int64_t st = r * ng + g;
            const float* raw = sblk + st * bs + (k_lo - base);
            float* p = sc + g * bs;
            // Vector steps in fixed chunks of the key index from k_lo, which depend only on the
            // row's position: a row gets the same bits on every path.
            float blk_max = -std::numeric_limits<float>::infinity();
            int64_t j = 0;
            if (softcap > 0.f) {
              for (; j < n; ++j) {
                p[j] = softcap * std::tanh(raw[j] * scale / softcap);
                blk_max = std::max(blk_max, p[j]);
              }
            } else {
              const VecF vs = VecF::set1(scale);
              VecF vm = VecF::set1(blk_max);
              for (; j + VecF::N <= n; j += VecF::N) {
                const VecF x = VecF::load(raw + j) * vs;
                x.store(p + j);
                vm = VecF::max(vm, x);
              }
              blk_max = vm.reduce_max();
              for (; j < n; ++j) {
                p[j] = raw[j] * scale;
                blk_max = std::max(blk_max, p[j]);
              }
            }
            const float m_new = std::max(m[st], blk_max);
            const float alpha = std::exp(m[st] - m_new);  // exp(-inf) = 0 on the first block
            // probabilities and their sum
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
            l[st] = l[st] * alpha + psum;
            m[st] = m_new;
            float* a = acc + st * d;
            if (alpha != 1.f) {
              const VecF va = VecF::set1(alpha);
              int64_t e = 0;
              for (; e + VecF::N <= d; e += VecF::N) (VecF::load(a + e) * va).store(a + e);
              for (; e < d; ++e) a[e] *= alpha;
            }
          }
          const float* vr = vb + (k_lo - base) * d;
          int64_t g = 0;
          for (; g + 2 <= ng; g += 2)
            accumulate_values2(acc + (r * ng + g) * d, sc + g * bs, acc + (r * ng + g + 1) * d, sc + (g + 1) * bs, vr, n,
                               d);
          if (g < ng) accumulate_values(acc + (r * ng + g) * d, sc + g * bs, vr, n, d);
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
