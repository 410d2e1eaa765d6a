// x86-64 AVX2 + FMA + F16C: 8 floats per vector.
#pragma once
#include <immintrin.h>
#include "../dtype.hpp"

namespace cpuserve {
namespace {  // internal linkage: every ISA unit has its own copy

namespace avx2_detail {
// Cephes-style exp: range reduction by ln2, degree-6 polynomial; ~1 ulp.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
}  // namespace avx2_detail

struct VecF {
  static constexpr int N = 8;
  static constexpr int kRegs = 16;  // vector registers the ISA has (micro-kernel blocking)
  static constexpr const char* kIsa = "avx2";
  __m256 v;

  static VecF zero() { return {_mm256_setzero_ps()}; }
  static VecF set1(float x) { return {_mm256_set1_ps(x)}; }
  static VecF load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static VecF i32(const int32_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static VecF load(const bf16* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
  }
  // Lanes i of bfloat16 pairs p[0, N): their low halves (h = 0: k) or high halves (h = 1: k + 1) as
  // float32, one shift or one mask where load(const bf16*) takes a zero-extension and a shift.
  static VecF widen_pair(const bf16p* p, int h) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_castsi256_ps(h == 0 ? _mm256_slli_epi32(x, 16) : _mm256_and_si256(x, _mm256_set1_epi32(-65536)))};
  }
  // Lanes i: half h of the bfloat16 pair p[i] (h = 0: the value at the lower address, 1: the
  // other) as float32: a paired bfloat16 cache's row (kernels/cache.hpp) widened in registers.
  static VecF widen_half(const bf16x2* p, int h) { return widen_pair(reinterpret_cast<const bf16p*>(p), h); }
  static VecF load(const f16* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  // Lanes i: float((p[i] >> shift) & mask), for N bytes at p (quantized weight codes).
  static VecF u8(const uint8_t* p, int shift, int mask) {
    __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    if (shift != 0) x = _mm256_srl_epi32(x, _mm_cvtsi32_si128(shift));
    if (mask != 255) x = _mm256_and_si256(x, _mm256_set1_epi32(mask));
    return {_mm256_cvtepi32_ps(x)};
  }
  // Lanes i: float(p[i] & 15) and float(p[i] >> 4), one load for both.
  static void nibbles(const uint8_t* p, VecF& lo, VecF& hi) {
    __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo.v = _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(15)));
    hi.v = _mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4));
  }
  // nibbles() with each code's high bits (5- and 6-bit codes): lanes i get
  // float(p[i] & 15 | ((h[i] >> s0) & m) << 4) and float(p[i] >> 4 | ((h[i] >> s1) & m) << 4),
  // m = 1 (s1 = s0 + 1) or 3 (s1 = s0 + 2). The high bytes are shifted right by s0 once and each
  // row's bits moved into place by a constant shift and ORed into the integer codes before the
  // one conversion a row: two conversions for two rows where nibbles() plus a u8() and an FMA a
  // row took four conversions and two FMAs, on the FP ports the GEMM's own FMAs need.
  static void nibbles_hi(const uint8_t* p, const uint8_t* h, int s0, int s1, int m, VecF& lo, VecF& hi) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i hx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h)));
    const __m256i t = _mm256_srl_epi32(hx, _mm_cvtsi32_si128(s0)), keep = _mm256_set1_epi32(m << 4);
    const __m256i h0 = _mm256_and_si256(_mm256_slli_epi32(t, 4), keep);
    const __m256i h1 = _mm256_and_si256(s1 - s0 == 1 ? _mm256_slli_epi32(t, 3) : _mm256_slli_epi32(t, 2), keep);
    lo.v = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(15)), h0));
    hi.v = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_srli_epi32(x, 4), h1));
  }
  static VecF load(const f8e5m2* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8))};
  }
  static VecF load(const f8e4m3* p) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_i32gather_ps(f8e4m3_table(), idx, 4)};
  }
  template <typename T> void store(T* p) const {
    alignas(32) float t[N];
    store(t);
    for (int i = 0; i < N; ++i) p[i] = from_float<T>(t[i]);
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(bf16* p) const {
    alignas(32) float t[N];
    _mm256_store_ps(t, v);
    for (int i = 0; i < N; ++i) p[i] = from_float<bf16>(t[i]);
  }
  void store(f16* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  friend VecF operator+(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend VecF operator-(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend VecF operator*(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend VecF operator/(VecF a, VecF b) { return {_mm256_div_ps(a.v, b.v)}; }
  static VecF fma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static VecF max(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
  float reduce_sum() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  float reduce_max() const {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  VecF exp() const { return {avx2_detail::exp_ps(v)}; }
};

// int8 dot products for the W8A8 GEMM (kernels/int8.hpp). A weight vector holds L columns x 4
// consecutive k as int8 ([-128, 127]); an activation broadcast holds 4 int8 in [-127, 127].
// dot(): lane l += sum_j a[j] * w[4l + j], exact in int32. kOffset: the activation bytes are
// fed as unsigned a + kOffset, so the caller subtracts kOffset * (the column's weight sum).
struct VecI8 {
  static constexpr int L = 8;
  static constexpr int kOffset = 0;
  __m256i v;
  using A = __m256i;
  static A bcast(int32_t a4) { return _mm256_set1_epi32(a4); }
  // maddubs on |w| and a with w's sign: |products| <= 128 * 127, pairs fit int16.
  static VecI8 dot(VecI8 acc, A a, const int8_t* w) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(a, wv));
    return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)))};
  }
  // Unsigned weight codes (at most 63) times signed activations (kernels/qdot.hpp): lane l +=
  // sum_j w[4l + j] * a[j]; u8 x s8 pairs fit int16 for such codes, so maddubs cannot saturate.
  using W = __m256i;
  static W loadw(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void nibbles(W x, W& lo, W& hi) {
    lo = _mm256_and_si256(x, _mm256_set1_epi8(15));
    hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), _mm256_set1_epi8(15));
  }
  // 5-bit codes: 16 added to the bytes of lo (hi) whose bit is set in bits[0, 4) ([4, 8)), LE:
  // each byte of the mask spread over 8 bytes, tested against its own bit.
  static __m256i bits16(const uint8_t* bits) {
    int32_t m;
    std::memcpy(&m, bits, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(m), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                               2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i sel = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel), _mm256_set1_epi8(16));
  }
  static void high_bits(W& lo, W& hi, const uint8_t* bits) {
    lo = _mm256_or_si256(lo, bits16(bits));
    hi = _mm256_or_si256(hi, bits16(bits + 4));
  }
  // 6-bit codes (kernels/qdot.hpp): bits 4-5 of lo's (hi's) bytes from bits S, S + 1 (S + 2, S + 3)
  // of h's, S 0 or 4.
  template <int S>
  static void high_two(W& lo, W& hi, W h) {
    const __m256i m = _mm256_set1_epi8(0x30);
    lo = _mm256_or_si256(lo, _mm256_and_si256(S == 0 ? _mm256_slli_epi16(h, 4) : h, m));
    hi = _mm256_or_si256(hi, _mm256_and_si256(S == 0 ? _mm256_slli_epi16(h, 2) : _mm256_srli_epi16(h, 2), m));
  }
  static A bcast_s(int32_t a4) { return _mm256_set1_epi32(a4); }
  static VecI8 dotu(VecI8 acc, W w, A a) {
    return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)))};
  }
  // 8-bit codes u = q + 128 (kernels/qdot.hpp): lane l += sum_j (u[4l + j] - 128) * a[j], exact:
  // maddubs would saturate on u, so |q| against a with q's sign (|q| * 127 pairs fit int16).
  static constexpr int kU8Bias = 0;
  struct W8 {
    __m256i mag, q;
  };
  static W8 codes8(W u) {
    const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
    return {_mm256_abs_epi8(q), q};
  }
  static VecI8 dotu8(VecI8 acc, const W8& w, A a) {
    const __m256i p16 = _mm256_maddubs_epi16(w.mag, _mm256_sign_epi8(a, w.q));
    return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)))};
  }
  static VecI8 zero() { return {_mm256_setzero_si256()}; }
  static VecI8 set1(int32_t x) { return {_mm256_set1_epi32(x)}; }
  void store(int32_t* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
};

}  // namespace
}  // namespace cpuserve
