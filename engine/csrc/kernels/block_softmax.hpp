// The online softmax step of attention (attention.hpp) for up to 16 (row, head)s of a block at
// once, in base 2, on every AVX-512 table and on AVX2: float probabilities for the float path (in
// place over the scores), bfloat16 ones for the pair path on vdpbf16ps and the path on AMX tiles.
// Written for the tiles first, which leave little else to do (in a 2,048-token prefill the softmax
// of a chunk's block took longer than its scores and values together); the other paths took it
// since, where the shared one (online_softmax, which the NEON, VXE and scalar tables keep) reduced
// each row on its own:
//   - exp2 of t = fma(u, c, -m) directly, c = scale * log2(e): no multiply by log2(e) and no
//     Cody-Waite split, no clamp on AVX-512 (t <= 0 always, and vscalefps takes 2^n of any n; AVX2
//     builds 2^n in the exponent bits, so t is held at -127 or above, where 2^-127's bits are 0), a
//     degree-5 polynomial for 2^f (AVX-512: f in [0, 1) from one vreduceps, exp2 below; AVX2: f in
//     [-1/2, 1/2]): 10 vector operations an exp on AVX-512 where the shared exp took 18 (AVX2: 12
//     where it took 20); degree 4 for bfloat16 probabilities (a 2,048-token prefill's attention on
//     AMX tiles, the Xeon with AMX, old and new in one binary taking turns: 0.95-0.98x the time, 1
//     and 2 threads), rounded two vectors at a time. The running max m is kept in base 2 too
//     (scaled by c), so alpha = 2^(m_old - m_new).
//   - the rows' horizontal maxima and sums as one transposed reduction (AVX-512: 45 operations for
//     16 rows where one row's reduction took 8; AVX2: 22 for 8 rows where one row's took 6).
//   - a row's keys that start or end inside a vector through masked loads and stores.
// The probabilities are stored by the exp pass itself (bfloat16 ones rounded there). Every row of
// a path takes this step, decode or prefill, whatever the batch: its bits depend only on its
// position (the vector steps start at the row's first key in the block; each row's reduction is a
// fixed tree of its own lanes), as on the other paths.
#pragma once
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include "../dtype.hpp"

namespace cpuserve {
namespace {  // (internal linkage, as every kernel header's: each ISA unit its own copy)
namespace block_softmax {

#ifdef __AVX512F__
using Vec = __m512;
[[gnu::always_inline]] inline Vec zero() { return _mm512_setzero_ps(); }

// 2^t per lane for t <= 0 (t finite: 2^t of a very negative t is 0, through vscalefps):
// 2^floor(t) * 2^f, f = t - floor(t) in [0, 1) from one vreduceps (exact but where t is in
// (-1/2, 0): there f rounds by at most 2^-25, 2e-8 relative in 2^f) and vscalefps taking the floor
// of t itself, where rounding t and subtracting took three micro-ops (vrndscaleps is two); 2^f a
// minimax polynomial on [0, 1), relative error 1.5e-7 evaluated in float32 at degree 5, 2.7e-6 at
// degree 4 (kDegree 4 where the result is rounded to bfloat16, 2^-9, at once and only the row sums
// see it whole, one FMA an exp fewer).
template <int kDegree = 5>
[[gnu::always_inline]] inline __m512 exp2(__m512 t) {
  static_assert(kDegree == 4 || kDegree == 5);
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 y;
  if constexpr (kDegree == 5) {
    y = _mm512_set1_ps(0.0018775769276544452f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.008989340625703335f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.05582631751894951f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.24015361070632935f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.6931530833244324f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.9999999403953552f));
  } else {
    y = _mm512_set1_ps(0.01353417057543993f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.05201146379113197f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.2414427548646927f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.6930038332939148f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0000026226043701f));
  }
  return _mm512_scalef_ps(y, t);  // y * 2^floor(t)
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
  constexpr int kDegree = std::is_same_v<P, float> ? 5 : 4;
  const __m512 vc = _mm512_set1_ps(c), vneg = _mm512_set1_ps(-m);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<P, bf16>) {  // two vectors to one: vcvtne2ps2bf16 the cost of one vcvtneps2bf16
    for (; j + 32 <= n; j += 32) {
      const __m512 e0 = exp2<kDegree>(_mm512_fmadd_ps(_mm512_loadu_ps(u + j), vc, vneg));
      const __m512 e1 = exp2<kDegree>(_mm512_fmadd_ps(_mm512_loadu_ps(u + j + 16), vc, vneg));
      _mm512_storeu_si512(to + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));  // NOLINT
      sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
    }
  }
#endif
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp2<kDegree>(_mm512_fmadd_ps(_mm512_loadu_ps(u + j), vc, vneg));
    store(to + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < n) {
    const __mmask16 k = lanes(n - j);
    const __m512 e = _mm512_maskz_mov_ps(k, exp2<kDegree>(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, u + j), vc, vneg)));
    store(to + j, e, k);
    sum = _mm512_add_ps(sum, e);
  }
  return sum;
}

#else  // AVX2: 8 lanes, 16 rows as two halves of 8
using Vec = __m256;
[[gnu::always_inline]] inline Vec zero() { return _mm256_setzero_ps(); }

// 2^t per lane for t <= 0: 2^n built in the exponent bits of n + 127, t held at -127 or above
// (2^-127's bits are 0, so every t below -126.5 gives 0, where AVX-512 gives subnormals).
[[gnu::always_inline]] inline __m256 exp2(__m256 t) {
  t = _mm256_max_ps(t, _mm256_set1_ps(-127.f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);  // exact, in [-1/2, 1/2]
  __m256 y = _mm256_set1_ps(0.001327697653323412f);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(0.009675545617938042f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(0.0555071160197258f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(0.24022120237350464f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(0.6931469440460205f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0000001192092896f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Lane r of the result: max (Max) or sum of v[r]'s 8 lanes, for r < 8 (transposed: halves, then
// lanes two apart, then neighbours, the tree row_reduce takes for one row).
template <bool Max>
[[gnu::always_inline]] inline __m256 reduce8(const __m256* v) {
  auto op = [](__m256 a, __m256 b) { return Max ? _mm256_max_ps(a, b) : _mm256_add_ps(a, b); };
  __m256 w[4], x[2];
  for (int i = 0; i < 4; ++i)  // [a0..3 b0..3] op [a4..7 b4..7]
    w[i] = op(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20), _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)  // in each 128-bit half: [a0 a1 c0 c1] op [a2 a3 c2 c3]
    x[i] = op(_mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44), _mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
  const __m256 z = op(_mm256_shuffle_ps(x[0], x[1], 0x88), _mm256_shuffle_ps(x[0], x[1], 0xDD));
  // z holds the vectors 0 2 4 6 1 3 5 7: put lane r on vector r
  return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// One row's max or sum in reduce8's tree for its lane.
template <bool Max>
[[gnu::always_inline]] inline float row_reduce(__m256 v) {
  auto op = [](__m128 a, __m128 b) { return Max ? _mm_max_ps(a, b) : _mm_add_ps(a, b); };
  __m128 s = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = op(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(op(s, _mm_movehdup_ps(s)));
}

// out[r] = max (Max) or sum of v[r]'s 8 lanes for r < mr (mr <= 16): 8 rows at a time, transposed
// (reduce8) for more than 3 of them, where it costs fewer operations than the rows one at a time
// (a decode's 3 heads of a group take those); the same bits either way.
template <bool Max>
[[gnu::always_inline]] inline void reduce_rows(const __m256* v, int mr, float* out) {
  for (int h = 0; h < mr; h += 8) {
    const int hr = std::min(8, mr - h);
    if (hr > 3) {
      _mm256_store_ps(out + h, reduce8<Max>(v + h));
    } else {
      for (int r = h; r < h + hr; ++r) out[r] = row_reduce<Max>(v[r]);
    }
  }
}

// The first min(n, 8) lanes, as a mask of 32-bit lanes (n > 0).
inline __m256i lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The max of u[0, n) (n > 0) as a vector of partial maxima.
[[gnu::always_inline]] inline __m256 row_max(const float* u, int64_t n) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 vm = ninf;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(u + j));
  if (j < n) {
    const __m256i k = lanes(n - j);
    vm = _mm256_max_ps(vm, _mm256_blendv_ps(ninf, _mm256_maskload_ps(u + j, k), _mm256_castsi256_ps(k)));
  }
  return vm;
}

// to[j] = 2^fma(u[j], c, -m) for j < n (to may be u); returns their sum as partial sums.
template <typename P>
[[gnu::always_inline]] inline __m256 row_exp(const float* u, int64_t n, float c, float m, P* to) {
  static_assert(std::is_same_v<P, float>, "AVX2 stores float probabilities");
  const __m256 vc = _mm256_set1_ps(c), vneg = _mm256_set1_ps(-m);
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp2(_mm256_fmadd_ps(_mm256_loadu_ps(u + j), vc, vneg));
    _mm256_storeu_ps(to + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (j < n) {
    const __m256i k = lanes(n - j);
    const __m256 e = _mm256_and_ps(_mm256_castsi256_ps(k),
                                   exp2(_mm256_fmadd_ps(_mm256_maskload_ps(u + j, k), vc, vneg)));
    _mm256_maskstore_ps(to + j, k, e);
    sum = _mm256_add_ps(sum, e);
  }
  return sum;
}
#endif

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
  Vec v[16];
  for (int r = 0; r < 16; ++r) {
    const bool has = r < mr && rows.n[r] > 0;
    if (has) c[r] = prepare_scores(rows.u[r], rows.n[r], scale, softcap);
    v[r] = has ? row_max(rows.u[r], rows.n[r]) : zero();
  }
  reduce_rows<true>(v, mr, m_new);
  for (int r = 0; r < mr; ++r) {
    const bool has = rows.n[r] > 0;
    m_new[r] = has ? std::max(m[r], m_new[r] * c[r]) : m[r];
    v[r] = has ? row_exp(rows.u[r], rows.n[r], c[r], m_new[r], rows.p[r]) : zero();
  }
  for (int r = mr; r < 16; ++r) v[r] = zero();
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
#endif  // __AVX512F__ || __AVX2__
