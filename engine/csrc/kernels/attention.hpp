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
#include "../vec/vec.hpp"

namespace cpuserve {
namespace {

constexpr int64_t kQTile = 16;

struct AttnItem { int32_t seq, kv_head, row0, rows; };

template <typename T>
inline void convert_to_float(float* dst, const T* src, int64_t n) {
  int64_t i = 0;
  for (; i + VecF::N <= n; i += VecF::N) VecF::load(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

inline float dot(const float* a, const float* b, int64_t d) {
  VecF acc = VecF::zero();
  int64_t i = 0;
  for (; i + VecF::N <= d; i += VecF::N) acc = VecF::fma(VecF::load(a + i), VecF::load(b + i), acc);
  float s = acc.reduce_sum();
  for (; i < d; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

template <typename T>
void paged_attention_t(float* out, const float* q, const T* k_cache, const T* v_cache,
                       const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_lens,
                       const int32_t* qsl, int64_t num_seqs, int64_t hq, int64_t hk, int64_t d,
                       int64_t bs, float scale, int64_t window, float softcap, int64_t q_stride,
                       int64_t out_stride) {
  const int64_t group = hq / hk;
  // The work list is rebuilt per call but reuses its storage: no allocation once warm.
  static thread_local std::vector<AttnItem> items;
  items.clear();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = qsl[s + 1] - qsl[s];
    for (int32_t r = 0; r < q_len; r += kQTile)
      for (int32_t h = 0; h < hk; ++h)
        items.push_back({static_cast<int32_t>(s), h, r, std::min<int32_t>(kQTile, q_len - r)});
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  const AttnItem* item_ptr = items.data();

#pragma omp parallel
  {
    // Per-thread scratch, sized once for the largest shape seen.
    static thread_local std::vector<float> scratch;
    const size_t need = static_cast<size_t>(kQTile * group * (d + 2) + bs + d);
    if (scratch.size() < need) scratch.resize(need);
    float* acc = scratch.data();                 // [rows][group][d]
    float* m = acc + kQTile * group * d;         // [rows][group]
    float* l = m + kQTile * group;               // [rows][group]
    float* sc = l + kQTile * group;              // [bs]
    float* kconv = sc + bs;                      // [d] one converted key or value row

#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const AttnItem w = item_ptr[it];
      const int64_t ctx = seq_lens[w.seq];
      const int64_t q_len = qsl[w.seq + 1] - qsl[w.seq];
      const int64_t first_pos = ctx - q_len + w.row0;  // position of the tile's first row
      const int64_t last_pos = first_pos + w.rows - 1;
      const int64_t lo_key = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      const int32_t* table = block_tables + w.seq * max_blocks;

      for (int64_t i = 0; i < w.rows * group; ++i) {
        m[i] = -std::numeric_limits<float>::infinity();
        l[i] = 0.f;
        std::fill(acc + i * d, acc + (i + 1) * d, 0.f);
      }
      for (int64_t b = lo_key / bs; b * bs <= last_pos; ++b) {
        const int64_t tile = (static_cast<int64_t>(table[b]) * hk + w.kv_head) * bs * d;
        const T* kb = k_cache + tile;
        const T* vb = v_cache + tile;
        const int64_t base = b * bs;
        for (int64_t r = 0; r < w.rows; ++r) {
          const int64_t pos = first_pos + r;
          const int64_t k_lo = std::max<int64_t>(base, window > 0 ? pos - window + 1 : 0);
          const int64_t k_hi = std::min<int64_t>(base + bs - 1, pos);  // inclusive
          if (k_lo > k_hi) continue;
          const int64_t tok = qsl[w.seq] + w.row0 + r;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t head = w.kv_head * group + g;
            const float* qv = q + tok * q_stride + head * d;
            const int64_t st = r * group + g;
            // scores
            float blk_max = -std::numeric_limits<float>::infinity();
            for (int64_t j = k_lo; j <= k_hi; ++j) {
              float s;
              if constexpr (std::is_same<T, float>::value) {
                s = dot(qv, kb + (j - base) * d, d) * scale;
              } else {
                convert_to_float(kconv, kb + (j - base) * d, d);
                s = dot(qv, kconv, d) * scale;
              }
              if (softcap > 0.f) s = softcap * std::tanh(s / softcap);
              sc[j - k_lo] = s;
              blk_max = std::max(blk_max, s);
            }
            const int64_t n = k_hi - k_lo + 1;
            const float m_new = std::max(m[st], blk_max);
            const float alpha = std::exp(m[st] - m_new);  // exp(-inf) = 0 on the first block
            // probabilities (vector exp in fixed chunks of the key index)
            const VecF vmax = VecF::set1(m_new);
            int64_t j = 0;
            for (; j + VecF::N <= n; j += VecF::N) (VecF::load(sc + j) - vmax).exp().store(sc + j);
            for (; j < n; ++j) sc[j] = std::exp(sc[j] - m_new);
            float psum = 0.f;
            for (j = 0; j < n; ++j) psum += sc[j];
            l[st] = l[st] * alpha + psum;
            m[st] = m_new;
            float* a = acc + st * d;
            const VecF va = VecF::set1(alpha);
            int64_t e = 0;
            for (; e + VecF::N <= d; e += VecF::N) (VecF::load(a + e) * va).store(a + e);
            for (; e < d; ++e) a[e] *= alpha;
            for (j = 0; j < n; ++j) {
              const T* vrow = vb + (k_lo + j - base) * d;
              const VecF p = VecF::set1(sc[j]);
              e = 0;
              for (; e + VecF::N <= d; e += VecF::N)
                VecF::fma(p, VecF::load(vrow + e), VecF::load(a + e)).store(a + e);
              for (; e < d; ++e) a[e] = std::fma(sc[j], to_float(vrow[e]), a[e]);
            }
          }
        }
      }
      for (int64_t r = 0; r < w.rows; ++r) {
        const int64_t tok = qsl[w.seq] + w.row0 + r;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t st = r * group + g;
          const float inv = l[st] > 0.f ? 1.f / l[st] : 0.f;
          float* o = out + tok * out_stride + (w.kv_head * group + g) * d;
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
                          int64_t hk, int64_t d, int64_t bs, float scale, int64_t window,
                          float softcap, int64_t q_stride, int64_t out_stride) {
  switch (dt) {
    case DType::F32:
      return paged_attention_t(out, q, static_cast<const float*>(k_cache), static_cast<const float*>(v_cache),
                               block_tables, max_blocks, seq_lens, qsl, num_seqs, hq, hk, d, bs, scale,
                               window, softcap, q_stride, out_stride);
    case DType::BF16:
      return paged_attention_t(out, q, static_cast<const bf16*>(k_cache), static_cast<const bf16*>(v_cache),
                               block_tables, max_blocks, seq_lens, qsl, num_seqs, hq, hk, d, bs, scale,
                               window, softcap, q_stride, out_stride);
    case DType::F16:
      return paged_attention_t(out, q, static_cast<const f16*>(k_cache), static_cast<const f16*>(v_cache),
                               block_tables, max_blocks, seq_lens, qsl, num_seqs, hq, hk, d, bs, scale,
                               window, softcap, q_stride, out_stride);
  }
}

}  // namespace
}  // namespace cpuserve
