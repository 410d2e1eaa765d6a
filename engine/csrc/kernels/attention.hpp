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

inline float dot(const float* a, const float* b, int64_t d) {
  VecF acc = VecF::zero();
  int64_t i = 0;
  for (; i + VecF::N <= d; i += VecF::N) acc = VecF::fma(VecF::load(a + i), VecF::load(b + i), acc);
  float s = acc.reduce_sum();
  for (; i < d; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

// Four dot products at once: four independent chains, each the same operations
// as dot(), so a key's score does not depend on which keys share its group.
inline void dot4(const float* q, const float* k, int64_t d, float* out) {
  VecF a0 = VecF::zero(), a1 = VecF::zero(), a2 = VecF::zero(), a3 = VecF::zero();
  int64_t i = 0;
  for (; i + VecF::N <= d; i += VecF::N) {
    const VecF qv = VecF::load(q + i);
    a0 = VecF::fma(qv, VecF::load(k + i), a0);
    a1 = VecF::fma(qv, VecF::load(k + d + i), a1);
    a2 = VecF::fma(qv, VecF::load(k + 2 * d + i), a2);
    a3 = VecF::fma(qv, VecF::load(k + 3 * d + i), a3);
  }
  float s[4] = {a0.reduce_sum(), a1.reduce_sum(), a2.reduce_sum(), a3.reduce_sum()};
  for (; i < d; ++i)
    for (int j = 0; j < 4; ++j) s[j] = std::fma(q[i], k[j * d + i], s[j]);
  for (int j = 0; j < 4; ++j) out[j] = s[j];
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
    const size_t need = static_cast<size_t>(kQTile * group * (d + 2) + bs + (kConvert ? 2 * bs * d : 0));
    if (scratch.size() < need) scratch.resize(need);
    float* acc = scratch.data();                 // [rows][group][d]
    float* m = acc + kQTile * group * d;         // [rows][group]
    float* l = m + kQTile * group;               // [rows][group]
    float* sc = l + kQTile * group;              // [bs] scores, then probabilities
    float* kbuf = sc + bs;                       // [bs][d] keys as float (narrow caches)
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
      for (int64_t b = lo_key / bs; b * bs <= last_pos; ++b) {
        const int64_t tile = (static_cast<int64_t>(table[b]) * hk + w.kv_head) * bs * d;
        const int64_t base = b * bs;
        // keys this tile's rows can see in this block
        const int64_t blk_lo = std::max<int64_t>(base, window > 0 ? first_pos - window + 1 : 0) - base;
        const int64_t blk_hi = std::min<int64_t>(base + bs - 1, last_pos) - base;  // inclusive
        const float* kb;
        const float* vb;
        if constexpr (kConvert) {
          convert_to_float(kbuf + blk_lo * d, k_cache + tile + blk_lo * d, (blk_hi - blk_lo + 1) * d, k_scale);
          convert_to_float(vbuf + blk_lo * d, v_cache + tile + blk_lo * d, (blk_hi - blk_lo + 1) * d, v_scale);
          kb = kbuf;
          vb = vbuf;
        } else {
          kb = k_cache + tile;
          vb = v_cache + tile;
        }
        for (int64_t r = 0; r < w.rows; ++r) {
          const int64_t pos = first_pos + r;
          const int64_t k_lo = std::max<int64_t>(base, window > 0 ? pos - window + 1 : 0);
          const int64_t k_hi = std::min<int64_t>(base + bs - 1, pos);  // inclusive
          if (k_lo > k_hi) continue;
          const int64_t n = k_hi - k_lo + 1;
          const float* kr = kb + (k_lo - base) * d;
          const int64_t tok = qsl[w.seq] + w.row0 + r;
          for (int64_t g = w.g0; g < w.g1; ++g) {
            const float* qv = q + tok * q_stride + g * d;
            const int64_t st = r * ng + (g - w.g0);
            int64_t j = 0;
            for (; j + 4 <= n; j += 4) dot4(qv, kr + j * d, d, sc + j);
            for (; j < n; ++j) sc[j] = dot(qv, kr + j * d, d);
            float blk_max = -std::numeric_limits<float>::infinity();
            for (j = 0; j < n; ++j) {
              float s = sc[j] * scale;
              if (softcap > 0.f) s = softcap * std::tanh(s / softcap);
              sc[j] = s;
              blk_max = std::max(blk_max, s);
            }
            const float m_new = std::max(m[st], blk_max);
            const float alpha = std::exp(m[st] - m_new);  // exp(-inf) = 0 on the first block
            // probabilities (vector exp in fixed chunks of the key index)
            const VecF vmax = VecF::set1(m_new);
            j = 0;
            for (; j + VecF::N <= n; j += VecF::N) (VecF::load(sc + j) - vmax).exp().store(sc + j);
            for (; j < n; ++j) sc[j] = std::exp(sc[j] - m_new);
            float psum = 0.f;
            for (j = 0; j < n; ++j) psum += sc[j];
            l[st] = l[st] * alpha + psum;
            m[st] = m_new;
            float* a = acc + st * d;
            if (alpha != 1.f) {
              const VecF va = VecF::set1(alpha);
              int64_t e = 0;
              for (; e + VecF::N <= d; e += VecF::N) (VecF::load(a + e) * va).store(a + e);
              for (; e < d; ++e) a[e] *= alpha;
            }
            accumulate_values(a, sc, vb + (k_lo - base) * d, n, d);
          }
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
