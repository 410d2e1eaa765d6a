// x86-64 AVX-512 (F, BW, VL, DQ): 16 floats per vector.
#pragma once
#include <immintrin.h>
#include "../dtype.hpp"

namespace cpuserve {
namespace {  // internal linkage: every ISA unit has its own copy

namespace avx512_detail {
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), _mm512_set1_ps(88.3762626647949f));
  __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  // y * 2^fx, exact: one instruction where building 2^fx's bits took four (the softmax's exp pass
  // about 6% faster), the same bits except at the clamp's ends (2^-127, 2^128), out of their reach
  return _mm512_scalef_ps(y, fx);
}
}  // namespace avx512_detail

struct VecF {
  static constexpr int N = 16;
  static constexpr int kRegs = 32;  // vector registers the ISA has (micro-kernel blocking)
#if defined(__AMX_BF16__)
  static constexpr const char* kIsa = "amx";
#elif defined(__AVX512BF16__)
  static constexpr const char* kIsa = "avx512_bf16";
#elif defined(__AVX512VNNI__)
  static constexpr const char* kIsa = "avx512_vnni";
#else
  static constexpr const char* kIsa = "avx512";
#endif
  __m512 v;

  static VecF zero() { return {_mm512_setzero_ps()}; }
  static VecF set1(float x) { return {_mm512_set1_ps(x)}; }
  static VecF load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static VecF i32(const int32_t* p) { return {_mm512_cvtepi32_ps(_mm512_loadu_si512(p))}; }
  static VecF load(const bf16* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  // Lanes i: half h of the bfloat16 pair p[i] (h = 0: the value at the lower address, 1: the
  // other) as float32: a paired bfloat16 cache's row (kernels/cache.hpp) widened in registers.
  static VecF widen_half(const bf16x2* p, int h) {
    const __m512i x = _mm512_loadu_si512(p);
    return {_mm512_castsi512_ps(h == 0 ? _mm512_slli_epi32(x, 16) : _mm512_and_si512(x, _mm512_set1_epi32(-65536)))};
  }
#ifndef __AVX512BF16__
  // Lanes i of bfloat16 pairs p[0, N): their low halves (h = 0: k) or high halves (h = 1: k + 1) as
  // float32, one shift or one mask where load(const bf16*) takes a zero-extension and a shift. The
  // tables without AVX-512 BF16 pack bfloat16 weights as such pairs (gemm.hpp widened_pairs), as
  // AVX2 does; with it they are multiplied as pairs by vdpbf16ps.
  static VecF widen_pair(const bf16p* p, int h) { return widen_half(reinterpret_cast<const bf16x2*>(p), h); }
#endif
  static VecF load(const f16* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
#ifdef __AVX512BF16__
  // bf16 pairs (k, k+1) as raw bits: 16 columns' pairs, or one pair in every lane.
  static VecF load(const bf16x2* p) { return {_mm512_castsi512_ps(_mm512_loadu_si512(p))}; }
  static VecF set1(bf16x2 x) { return {_mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(x.bits)))}; }
  // c + a.hi * b.hi + a.lo * b.lo per lane (vdpbf16ps: the high pair first, each sum rounded
  // to nearest even, denormal inputs and results flushed to zero)
  static VecF dot2(VecF a, VecF b, VecF c) {
    return {_mm512_dpbf16_ps(c.v, (__m512bh)a.v, (__m512bh)b.v)};  // NOLINT: same-size vector casts
  }
  // The 16 lanes rounded to bfloat16 at dst (nearest even; denormals flushed, as vdpbf16ps reads them).
  void store_bf16(bf16* dst) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));  // NOLINT: same size
  }
#endif
  // Lanes i: float((p[i] >> shift) & mask), for N bytes at p (quantized weight codes).
  static VecF u8(const uint8_t* p, int shift, int mask) {
    __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if (shift != 0) x = _mm512_srl_epi32(x, _mm_cvtsi32_si128(shift));
    if (mask != 255) x = _mm512_and_si512(x, _mm512_set1_epi32(mask));
    return {_mm512_cvtepi32_ps(x)};
  }
  // Lanes i: float(p[i] & 15) and float(p[i] >> 4), one load for both.
  static void nibbles(const uint8_t* p, VecF& lo, VecF& hi) {
    __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo.v = _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(15)));
    hi.v = _mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4));
  }
  // nibbles() with each code's high bits (5- and 6-bit codes): lanes i get
  // float(p[i] & 15 | ((h[i] >> s0) & m) << 4) and float(p[i] >> 4 | ((h[i] >> s1) & m) << 4),
  // m = 1 or 3. Each high bit is tested on the bytes into a lane mask that ORs 16 (or 32) into
  // the integer code before the one conversion: 9 instructions for two rows of 5-bit codes,
  // against 15 for nibbles() plus a u8() and an FMA per row.
  static void nibbles_hi(const uint8_t* p, const uint8_t* h, int s0, int s1, int m, VecF& lo, VecF& hi) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m128i hb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h));
    __m512i l = _mm512_and_si512(x, _mm512_set1_epi32(15)), u = _mm512_srli_epi32(x, 4);
    for (int j = 0; j < (m == 1 ? 1 : 2); ++j) {
      const __m512i add = _mm512_set1_epi32(16 << j);
      l = _mm512_mask_or_epi32(l, _mm_test_epi8_mask(hb, _mm_set1_epi8(static_cast<char>(1 << (s0 + j)))), l, add);
      u = _mm512_mask_or_epi32(u, _mm_test_epi8_mask(hb, _mm_set1_epi8(static_cast<char>(1 << (s1 + j)))), u, add);
    }
    lo.v = _mm512_cvtepi32_ps(l);
    hi.v = _mm512_cvtepi32_ps(u);
  }
  static VecF load(const f8e5m2* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8))};
  }
  static VecF load(const f8e4m3* p) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm512_i32gather_ps(idx, f8e4m3_table(), 4)};
  }
  template <typename T> void store(T* p) const {
    alignas(64) float t[N];
    store(t);
    for (int i = 0; i < N; ++i) p[i] = from_float<T>(t[i]);
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(bf16* p) const {
    alignas(64) float t[N];
    _mm512_store_ps(t, v);
    for (int i = 0; i < N; ++i) p[i] = from_float<bf16>(t[i]);
  }
  void store(f16* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  friend VecF operator+(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend VecF operator-(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend VecF operator*(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend VecF operator/(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
  static VecF fma(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static VecF max(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
  float reduce_sum() const { return _mm512_reduce_add_ps(v); }
  float reduce_max() const { return _mm512_reduce_max_ps(v); }
  VecF exp() const { return {avx512_detail::exp_ps(v)}; }
};

// int8 dot products for the W8A8 GEMM (kernels/int8.hpp). A weight vector holds L columns x 4
// consecutive k as int8 ([-128, 127]); an activation broadcast holds 4 int8 in [-127, 127].
// dot(): lane l += sum_j a[j] * w[4l + j], exact in int32. kOffset: the activation bytes are
// fed as unsigned a + kOffset, so the caller subtracts kOffset * (the column's weight sum).
struct VecI8 {
  static constexpr int L = 16;
  __m512i v;
#ifdef __AVX512VNNI__
  static constexpr int kOffset = 128;
  using A = __m512i;
  static A bcast(int32_t a4) { return _mm512_set1_epi32(a4 ^ int32_t(0x80808080u)); }
  static VecI8 dot(VecI8 acc, A a, const int8_t* w) {
    return {_mm512_dpbusd_epi32(acc.v, a, _mm512_loadu_si512(w))};
  }
#else
  // maddubs on |w| and a with w's sign: |products| <= 128 * 127, pairs fit int16.
  static constexpr int kOffset = 0;
  using A = __m512i;
  static A bcast(int32_t a4) { return _mm512_set1_epi32(a4); }
  static VecI8 dot(VecI8 acc, A a, const int8_t* w) {
    const __m512i wv = _mm512_loadu_si512(w);
    const __m512i sa = _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), a);
    const __m512i p16 = _mm512_maddubs_epi16(_mm512_abs_epi8(wv), sa);
    return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(p16, _mm512_set1_epi16(1)))};
  }
#endif
  // Unsigned weight codes (at most 63) times signed activations (kernels/qdot.hpp): lane l +=
  // sum_j w[4l + j] * a[j]; u8 x s8 pairs fit int16 for such codes, so maddubs cannot saturate.
  using W = __m512i;
  static W loadw(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static void nibbles(W x, W& lo, W& hi) {
    lo = _mm512_and_si512(x, _mm512_set1_epi8(15));
    hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), _mm512_set1_epi8(15));
  }
  // 5-bit codes: 16 added to the bytes of lo (hi) whose bit is set in bits[0, 8) ([8, 16)), LE.
  static void high_bits(W& lo, W& hi, const uint8_t* bits) {
    uint64_t m0, m1;
    std::memcpy(&m0, bits, 8);
    std::memcpy(&m1, bits + 8, 8);
    const __m512i s = _mm512_set1_epi8(16);
    lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(m0), lo, s);
    hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(m1), hi, s);
  }
  // 6-bit codes (kernels/qdot.hpp): bits 4-5 of lo's (hi's) bytes from bits S, S + 1 (S + 2, S + 3)
  // of h's, S 0 or 4.
  template <int S>
  static void high_two(W& lo, W& hi, W h) {
    const __m512i m = _mm512_set1_epi8(0x30);
    lo = _mm512_or_si512(lo, _mm512_and_si512(S == 0 ? _mm512_slli_epi16(h, 4) : h, m));
    hi = _mm512_or_si512(hi, _mm512_and_si512(S == 0 ? _mm512_slli_epi16(h, 2) : _mm512_srli_epi16(h, 2), m));
  }
  static A bcast_s(int32_t a4) { return _mm512_set1_epi32(a4); }
  static VecI8 dotu(VecI8 acc, W w, A a) {
#ifdef __AVX512VNNI__
    return {_mm512_dpbusd_epi32(acc.v, w, a)};
#else
    return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(w, a), _mm512_set1_epi16(1)))};
#endif
  }
  // 8-bit codes u = q + 128 (kernels/qdot.hpp): lane l += sum_j (u[4l + j] - 128 + kU8Bias) * a[j],
  // exact. VNNI: vpdpbusd on u as it is (no int16 step), the caller starts from -128 * sum a.
  // maddubs would saturate on u, so there: |q| against a with q's sign (|q| * 127 pairs fit).
#ifdef __AVX512VNNI__
  static constexpr int kU8Bias = 128;
  using W8 = __m512i;
  static W8 codes8(W u) { return u; }
  static VecI8 dotu8(VecI8 acc, W8 u, A a) { return {_mm512_dpbusd_epi32(acc.v, u, a)}; }
#else
  static constexpr int kU8Bias = 0;
  struct W8 {
    __m512i mag;
    __mmask64 neg;
  };
  static W8 codes8(W u) {
    const __m512i q = _mm512_xor_si512(u, _mm512_set1_epi8(static_cast<char>(0x80)));
    return {_mm512_abs_epi8(q), _mm512_movepi8_mask(q)};
  }
  static VecI8 dotu8(VecI8 acc, const W8& w, A a) {
    const __m512i sa = _mm512_mask_sub_epi8(a, w.neg, _mm512_setzero_si512(), a);
    return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(w.mag, sa), _mm512_set1_epi16(1)))};
  }
#endif
  static VecI8 zero() { return {_mm512_setzero_si512()}; }
  static VecI8 set1(int32_t x) { return {_mm512_set1_epi32(x)}; }
  void store(int32_t* p) const { _mm512_storeu_si512(p, v); }
};

}  // namespace
}  // namespace cpuserve
