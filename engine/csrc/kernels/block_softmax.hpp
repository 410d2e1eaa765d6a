// The online softmax step of attention (attention.hpp) for up to 16 (row, head)s of a block at
// once, in base 2, on every AVX-512 table: float probabilities for the float path (in place over
// the scores), bfloat16 ones for the pair path on vdpbf16ps and the path on AMX tiles. Written for
// the tiles first, which leave little else to do (in a 2,048-token prefill the softmax of a
// chunk's block took longer than its scores and values together); the other paths took it since,
// where the shared one (online_softmax, which the AVX2 and other tables keep) reduced each row on
// its own:
//   - exp2 of t = fma(u, c, -m) directly, c = scale * log2(e): no multiply by log2(e) and no
//     Cody-Waite split, no clamp (t <= 0 always, and vscalefps takes 2^n of any n), a degree-5
//     polynomial for 2^f on [-1/2, 1/2] (relative error 2.3e-7 evaluated in float32): 11 vector
//     operations an exp where the shared exp took 18. The running max m is kept in base 2 too
//     (scaled by c), so alpha = 2^(m_old - m_new).
//   - the 16 rows' horizontal maxima and sums as one transposed reduction (45 operations for the
//     16 rows where one row's reduction took 8).
//   - a row's keys that start or end inside a vector through masked loads and stores.
// The probabilities are stored by the exp pass itself (bfloat16 ones rounded there). Every row of
// a path takes this step, decode or prefill, whatever the batch: its bits depend only on its
// position (the vector steps start at the row's first key in the block; each row's reduction is a
// fixed tree of its own lanes), as on the other paths.
#pragma once
#ifdef __AVX512F__
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include "../dtype.hpp"

namespace cpuserve {
namespace {  // (internal linkage, as every kernel header's: each ISA unit its own copy)
namespace block_softmax {

// 2^t per lane for t <= 0 (t finite: 2^t of a very negative t is 0, through vscalefps).
[[gnu::always_inline]] inline __m512 exp2(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // exact, in [-1/2, 1/2]
  __m512 y = _mm512_set1_ps(0.001327697653323412f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.009675545617938042f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.0555071160197258f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.24022120237350464f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.6931469440460205f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_scalef_ps(y, n);
}

// Lane r of the result: max (Max) or sum of v[r]'s 16 lanes, for r < 16 (a transposed reduction:
// each level halves the vectors and the lanes each one's values span).
template <bool Max>
[[gnu::always_inline]] inline __m512 reduce16(const __m512* v) {
  auto op = [](__m512 a, __m512 b) { return Max ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b); };
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // 128-bit blocks: [a0 a1 b0 b1] op [a2 a3 b2 b3]
    w[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // blocks: [a b c d], each one vector's 4 partial lanes
    x[i] = op(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88), _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // in each block: [a01 a23 e01 e23]-style pairs
    y[i] = op(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  const __m512 z = op(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  // z's lanes hold the vectors in the order the shuffles left them; put lane r on vector r
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

// out[r] = max (Max) or sum of v[r]'s 16 lanes for r < mr: transposed (reduce16) for more than 4
// rows, where it costs fewer operations than the rows one at a time (a decode's 3 heads of a
// group take those). _mm512_reduce_add_ps adds a vector's lanes in reduce16's tree for its lane
// (halves, then quarters, then pairs within a block, then neighbours: 3.2 million rows bit for
// bit; tests/engine/csrc/block_softmax_tests.cpp holds whole steps to it), so a row's sum does
// not depend on how many rows share its step.
template <bool Max>
[[gnu::always_inline]] inline void reduce_rows(const __m512* v, int mr, float* out) {
  if (mr > 4) return _mm512_store_ps(out, reduce16<Max>(v));
  for (int r = 0; r < mr; ++r) out[r] = Max ? _mm512_reduce_max_ps(v[r]) : _mm512_reduce_add_ps(v[r]);
}

inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// The max of u[0, n) (n > 0) as a vector of partial maxima.
[[gnu::always_inline]] inline __m512 row_max(const float* u, int64_t n) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 vm = ninf;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(u + j));
  if (j < n) vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(ninf, lanes(n - j), u + j));
  return vm;
}

// e (its lanes k) stored at to, as float or rounded to bfloat16.
[[gnu::always_inline]] inline void store(float* to, __m512 e) { _mm512_storeu_ps(to, e); }
[[gnu::always_inline]] inline void store(float* to, __m512 e, __mmask16 k) { _mm512_mask_storeu_ps(to, k, e); }
#ifdef __AVX512BF16__
[[gnu::always_inline]] inline void store(bf16* to, __m512 e) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), (__m256i)_mm512_cvtneps_pbh(e));  // NOLINT
}
[[gnu::always_inline]] inline void store(bf16* to, __m512 e, __mmask16 k) {
  _mm256_mask_storeu_epi16(to, k, (__m256i)_mm512_cvtneps_pbh(e));  // NOLINT
}
#endif

// to[j] = 2^fma(u[j], c, -m) for j < n (float, or rounded to bfloat16; to may be u); returns their
// float32 sum as partial sums.
template <typename P>
[[gnu::always_inline]] inline __m512 row_exp(const float* u, int64_t n, float c, float m, P* to) {
  const __m512 vc = _mm512_set1_ps(c), vneg = _mm512_set1_ps(-m);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp2(_mm512_fmadd_ps(_mm512_loadu_ps(u + j), vc, vneg));
    store(to + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < n) {
    const __mmask16 k = lanes(n - j);
    const __m512 e = _mm512_maskz_mov_ps(k, exp2(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, u + j), vc, vneg)));
    store(to + j, e, k);
    sum = _mm512_add_ps(sum, e);
  }
  return sum;
}

// The scores u[0, n) made ready for the exp pass where its multiply-add cannot take them raw
// (a softcap: softcap * tanh(s * scale / softcap); a scale <= 0: s * scale), in place; returns
// the factor c the exp pass applies: scale * log2(e) on raw scores, log2(e) on prepared ones.
inline float prepare_scores(float* u, int64_t n, float scale, float softcap) {
  constexpr float kLog2e = 1.44269504088896341f;
  if (softcap > 0.f) {
    for (int64_t j = 0; j < n; ++j) u[j] = softcap * std::tanh(u[j] * scale / softcap);
    return kLog2e;
  }
  if (scale > 0.f) return scale * kLog2e;  // a positive factor keeps the scores' order: max first
  for (int64_t j = 0; j < n; ++j) u[j] *= scale;
  return kLog2e;
}

// One block's softmax step for rows r < mr: row r's keys are u[r] [0, n[r]) (n[r] <= 0: none),
// its probabilities go to p[r] [0, n[r]) (float, in place where p[r] is u[r], or bfloat16); m[r]
// (base 2) and l[r] move on, and returns in alpha[r] the factor the row's accumulator takes (1
// where its max did not move).
template <typename P>
struct Rows16 {
  float* u[16];
  P* p[16];
  int64_t n[16];
};
template <typename P>
inline void step(const Rows16<P>& rows, int mr, float scale, float softcap, float* m, float* l, float* alpha) {
  alignas(64) float c[16], m_new[16], psum[16];
  __m512 v[16];
  for (int r = 0; r < 16; ++r) {
    const bool has = r < mr && rows.n[r] > 0;
    if (has) c[r] = prepare_scores(rows.u[r], rows.n[r], scale, softcap);
    v[r] = has ? row_max(rows.u[r], rows.n[r]) : _mm512_setzero_ps();
  }
  reduce_rows<true>(v, mr, m_new);
  for (int r = 0; r < mr; ++r) {
    const bool has = rows.n[r] > 0;
    m_new[r] = has ? std::max(m[r], m_new[r] * c[r]) : m[r];
    v[r] = has ? row_exp(rows.u[r], rows.n[r], c[r], m_new[r], rows.p[r]) : _mm512_setzero_ps();
  }
  for (int r = mr; r < 16; ++r) v[r] = _mm512_setzero_ps();
  reduce_rows<false>(v, mr, psum);
  for (int r = 0; r < mr; ++r) {
    alpha[r] = m_new[r] == m[r] ? 1.f : std::exp2(m[r] - m_new[r]);  // 2^-inf = 0 on the first block
    if (rows.n[r] > 0) l[r] = l[r] * alpha[r] + psum[r];
    m[r] = m_new[r];
  }
}

}  // namespace block_softmax
}  // namespace
}  // namespace cpuserve
#endif  // __AVX512F__
