// AArch64 Advanced SIMD (NEON): 4 floats per vector; fp16 through vcvt.
#pragma once
#include <arm_neon.h>
#include "../dtype.hpp"

namespace cpuserve {
namespace {  // internal linkage: every ISA unit has its own copy

namespace neon_detail {
inline float32x4_t exp_ps(float32x4_t x) {
  x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-88.3762626647949f)), vdupq_n_f32(88.3762626647949f));
  float32x4_t fx = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
  x = vfmsq_f32(x, fx, vdupq_n_f32(0.693359375f));
  x = vfmsq_f32(x, fx, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t y = vdupq_n_f32(1.9875691500E-4f);
  y = vfmaq_f32(vdupq_n_f32(1.3981999507E-3f), y, x);
  y = vfmaq_f32(vdupq_n_f32(8.3334519073E-3f), y, x);
  y = vfmaq_f32(vdupq_n_f32(4.1665795894E-2f), y, x);
  y = vfmaq_f32(vdupq_n_f32(1.6666665459E-1f), y, x);
  y = vfmaq_f32(vdupq_n_f32(5.0000001201E-1f), y, x);
  y = vfmaq_f32(vaddq_f32(x, vdupq_n_f32(1.f)), y, vmulq_f32(x, x));
  int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(fx), vdupq_n_s32(127)), 23);
  return vmulq_f32(y, vreinterpretq_f32_s32(e));
}
}  // namespace neon_detail

struct VecF {
  static constexpr int N = 4;
  static constexpr int kRegs = 32;  // vector registers the ISA has (micro-kernel blocking)
#ifdef __ARM_FEATURE_DOTPROD
  static constexpr const char* kIsa = "neon_dotprod";
#else
  static constexpr const char* kIsa = "neon";
#endif
  float32x4_t v;

  static VecF zero() { return {vdupq_n_f32(0.f)}; }
  static VecF set1(float x) { return {vdupq_n_f32(x)}; }
  static VecF load(const float* p) { return {vld1q_f32(p)}; }
  static VecF i32(const int32_t* p) { return {vcvtq_f32_s32(vld1q_s32(p))}; }
  static VecF load(const bf16* p) {
    uint16x4_t h = vld1_u16(reinterpret_cast<const uint16_t*>(p));
    return {vreinterpretq_f32_u32(vshll_n_u16(h, 16))};
  }
  // Lanes i: half h of the bfloat16 pair p[i] (h = 0: the value at the lower address, 1: the
  // other) as float32: a paired bfloat16 cache's row (kernels/cache.hpp) widened in registers.
  static VecF widen_half(const bf16x2* p, int h) {
    const uint32x4_t x = vld1q_u32(reinterpret_cast<const uint32_t*>(p));
    return {vreinterpretq_f32_u32(h == 0 ? vshlq_n_u32(x, 16) : vandq_u32(x, vdupq_n_u32(0xffff0000u)))};
  }
  static VecF load(const f16* p) {
    return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))))};
  }
  // Lanes i: float((p[i] >> shift) & mask), for N bytes at p (quantized weight codes).
  static VecF u8(const uint8_t* p, int shift, int mask) {
    uint32_t w;
    std::memcpy(&w, p, 4);
    uint32x4_t x = vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(w)))));
    x = vandq_u32(vshlq_u32(x, vdupq_n_s32(-shift)), vdupq_n_u32(static_cast<uint32_t>(mask)));
    return {vcvtq_f32_u32(x)};
  }
  // Lanes i: float(p[i] & 15) and float(p[i] >> 4), one load for both.
  static void nibbles(const uint8_t* p, VecF& lo, VecF& hi) {
    lo = u8(p, 0, 15);
    hi = u8(p, 4, 15);
  }
  static VecF load(const f8e5m2* p) {
    uint32_t w;
    std::memcpy(&w, p, 4);
    const uint16x4_t h = vshl_n_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(w)))), 8);
    return {vcvt_f32_f16(vreinterpret_f16_u16(h))};
  }
  static VecF load(const f8e4m3* p) {
    alignas(64) float t[N];
    const float* lut = f8e4m3_table();
    for (int i = 0; i < N; ++i) t[i] = lut[p[i].bits];
    return load(t);
  }
  template <typename T> void store(T* p) const {
    alignas(64) float t[N];
    store(t);
    for (int i = 0; i < N; ++i) p[i] = from_float<T>(t[i]);
  }
  void store(float* p) const { vst1q_f32(p, v); }
  void store(bf16* p) const {
    float t[N];
    vst1q_f32(t, v);
    for (int i = 0; i < N; ++i) p[i] = from_float<bf16>(t[i]);
  }
  void store(f16* p) const {
    vst1_u16(reinterpret_cast<uint16_t*>(p), vreinterpret_u16_f16(vcvt_f16_f32(v)));
  }
  friend VecF operator+(VecF a, VecF b) { return {vaddq_f32(a.v, b.v)}; }
  friend VecF operator-(VecF a, VecF b) { return {vsubq_f32(a.v, b.v)}; }
  friend VecF operator*(VecF a, VecF b) { return {vmulq_f32(a.v, b.v)}; }
  friend VecF operator/(VecF a, VecF b) { return {vdivq_f32(a.v, b.v)}; }
  static VecF fma(VecF a, VecF b, VecF c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
  static VecF max(VecF a, VecF b) { return {vmaxq_f32(a.v, b.v)}; }
  float reduce_sum() const { return vaddvq_f32(v); }
  float reduce_max() const { return vmaxvq_f32(v); }
  VecF exp() const { return {neon_detail::exp_ps(v)}; }
};

// int8 dot products for the W8A8 GEMM (kernels/int8.hpp). A weight vector holds L columns x 4
// consecutive k as int8 ([-128, 127]); an activation broadcast holds 4 int8 in [-127, 127].
// dot(): lane l += sum_j a[j] * w[4l + j], exact in int32. kOffset: the activation bytes are
// fed as unsigned a + kOffset, so the caller subtracts kOffset * (the column's weight sum).
struct VecI8 {
  static constexpr int L = 4;
  static constexpr int kOffset = 0;
  int32x4_t v;
  using A = int8x16_t;
  static A bcast(int32_t a4) { return vreinterpretq_s8_s32(vdupq_n_s32(a4)); }
  static VecI8 dot(VecI8 acc, A a, const int8_t* w) { return dotu(acc, loadw(reinterpret_cast<const uint8_t*>(w)), a); }
  // Weight bytes as int8 (codes of at most 63 for kernels/qdot.hpp, any int8 for dot()) times
  // signed activations: lane l += sum_j w[4l + j] * a[j].
  using W = uint8x16_t;
  static W loadw(const uint8_t* p) { return vld1q_u8(p); }
  static void nibbles(W x, W& lo, W& hi) { lo = vandq_u8(x, vdupq_n_u8(15)); hi = vshrq_n_u8(x, 4); }
  // 5-bit codes: 16 added to the bytes of lo (hi) whose bit is set in bits[0, 2) ([2, 4)).
  static uint8x16_t bits16(const uint8_t* bits) {
    const uint8x16_t spread = vcombine_u8(vdup_n_u8(bits[0]), vdup_n_u8(bits[1]));
    const uint8x16_t sel = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    return vandq_u8(vtstq_u8(spread, sel), vdupq_n_u8(16));
  }
  static void high_bits(W& lo, W& hi, const uint8_t* bits) {
    lo = vorrq_u8(lo, bits16(bits));
    hi = vorrq_u8(hi, bits16(bits + 2));
  }
  // 6-bit codes (kernels/qdot.hpp): bits 4-5 of lo's (hi's) bytes from bits S, S + 1 (S + 2, S + 3)
  // of h's, S 0 or 4.
  template <int S>
  static void high_two(W& lo, W& hi, W h) {
    const uint8x16_t m = vdupq_n_u8(0x30);
    lo = vorrq_u8(lo, vandq_u8(S == 0 ? vshlq_n_u8(h, 4) : h, m));
    hi = vorrq_u8(hi, vandq_u8(S == 0 ? vshlq_n_u8(h, 2) : vshrq_n_u8(h, 2), m));
  }
  static A bcast_s(int32_t a4) { return bcast(a4); }
  static VecI8 dotu(VecI8 acc, W w, A a) {
    const int8x16_t wv = vreinterpretq_s8_u8(w);
#ifdef __ARM_FEATURE_DOTPROD
    return {vdotq_s32(acc.v, wv, a)};
#else
    // int16 products, adjacent pairs summed (<= 2 * 128 * 127), then pairs of pairs into int32
    const int16x8_t lo = vmull_s8(vget_low_s8(wv), vget_low_s8(a));
    const int16x8_t hi = vmull_s8(vget_high_s8(wv), vget_high_s8(a));
    return {vpadalq_s16(acc.v, vpaddq_s16(lo, hi))};
#endif
  }
  // 8-bit codes u = q + 128 (kernels/qdot.hpp): lane l += sum_j (u[4l + j] - 128) * a[j], exact:
  // q = u ^ 0x80 as int8 through dotu (pairs of int16 products <= 2 * 128 * 127).
  static constexpr int kU8Bias = 0;
  using W8 = W;
  static W8 codes8(W u) { return veorq_u8(u, vdupq_n_u8(0x80)); }
  static VecI8 dotu8(VecI8 acc, W8 q, A a) { return dotu(acc, q, a); }
  static VecI8 zero() { return {vdupq_n_s32(0)}; }
  static VecI8 set1(int32_t x) { return {vdupq_n_s32(x)}; }
  void store(int32_t* p) const { vst1q_s32(p, v); }
};

}  // namespace
}  // namespace cpuserve
