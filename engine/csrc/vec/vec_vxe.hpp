// IBM Z vector facility with the z14 enhancements (VXE): 4 floats per vector.
// z14 has no half-precision conversions, so float16 is not offered on s390x.
#pragma once
#include <vecintrin.h>
#include <cmath>
#include "../dtype.hpp"

namespace cpuserve {
namespace {  // internal linkage: every ISA unit has its own copy

struct VecF {
  static constexpr int N = 4;
  static constexpr int kRegs = 32;  // vector registers the ISA has (micro-kernel blocking)
  static constexpr const char* kIsa = "vxe";
  __vector float v;

  static VecF zero() { return {vec_splats(0.f)}; }
  static VecF set1(float x) { return {vec_splats(x)}; }
  static VecF load(const float* p) { return {vec_xl(0, p)}; }
  static VecF i32(const int32_t* p) {  // z14 has no 32-bit integer to float vector conversion
    alignas(16) float t[N];
    for (int i = 0; i < N; ++i) t[i] = static_cast<float>(p[i]);
    return load(t);
  }
  static VecF load(const bf16* p) {
    __vector unsigned short h = vec_xl(0, reinterpret_cast<const unsigned short*>(p));
    __vector unsigned int w = vec_unpackh(h);  // first four elements, zero-extended
    // element-wise shift (vec_sll would shift the whole register)
    return {reinterpret_cast<__vector float>(w << 16)};
  }
  // Lanes i: half h of the bfloat16 pair p[i] (h = 0: the value at the lower address, 1: the
  // other) as float32 (big-endian: the lower address holds a word's high half): a paired bfloat16 cache's row (kernels/cache.hpp) widened in registers.
  static VecF widen_half(const bf16x2* p, int h) {
    const __vector unsigned int x = vec_xl(0, reinterpret_cast<const unsigned int*>(p));
    const __vector unsigned int hi_half = {0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u};
    return {reinterpret_cast<__vector float>(h == 0 ? (x & hi_half) : (x << 16))};
  }
  static VecF load(const f16* p) {
    VecF r;
    for (int i = 0; i < N; ++i) r.v[i] = to_float(p[i]);
    return r;
  }
  // Lanes i: float((p[i] >> shift) & mask), for N bytes at p (quantized weight codes).
  static VecF u8(const uint8_t* p, int shift, int mask) {
    VecF r;
    for (int i = 0; i < N; ++i) r.v[i] = static_cast<float>((p[i] >> shift) & mask);
    return r;
  }
  // Lanes i: float(p[i] & 15) and float(p[i] >> 4), one load for both.
  static void nibbles(const uint8_t* p, VecF& lo, VecF& hi) {
    lo = u8(p, 0, 15);
    hi = u8(p, 4, 15);
  }
  static VecF load(const f8e5m2* p) {
    VecF r;
    for (int i = 0; i < N; ++i) r.v[i] = to_float(p[i]);
    return r;
  }
  static VecF load(const f8e4m3* p) {
    VecF r;
    for (int i = 0; i < N; ++i) r.v[i] = to_float(p[i]);
    return r;
  }
  void store(float* p) const { vec_xst(v, 0, p); }
  template <typename T> void store(T* p) const {
    for (int i = 0; i < N; ++i) p[i] = from_float<T>(v[i]);
  }
  friend VecF operator+(VecF a, VecF b) { return {a.v + b.v}; }
  friend VecF operator-(VecF a, VecF b) { return {a.v - b.v}; }
  friend VecF operator*(VecF a, VecF b) { return {a.v * b.v}; }
  friend VecF operator/(VecF a, VecF b) { return {a.v / b.v}; }
  static VecF fma(VecF a, VecF b, VecF c) { return {vec_madd(a.v, b.v, c.v)}; }
  static VecF max(VecF a, VecF b) { return {vec_max(a.v, b.v)}; }
  float reduce_sum() const { return (v[0] + v[1]) + (v[2] + v[3]); }
  float reduce_max() const { return std::fmax(std::fmax(v[0], v[1]), std::fmax(v[2], v[3])); }
  VecF exp() const {
    VecF r;
    for (int i = 0; i < N; ++i) r.v[i] = std::exp(v[i]);
    return r;
  }
};

// int8 dot products for the W8A8 GEMM (kernels/int8.hpp). A weight vector holds L columns x 4
// consecutive k as int8 ([-128, 127]); an activation broadcast holds 4 int8 in [-127, 127].
// dot(): lane l += sum_j a[j] * w[4l + j], exact in int32. kOffset: the activation bytes are
// fed as unsigned a + kOffset, so the caller subtracts kOffset * (the column's weight sum).
struct VecI8 {
  static constexpr int L = 4;
  static constexpr int kOffset = 0;
  __vector signed int v;
  using A = __vector signed char;
  static A bcast(int32_t a4) { return reinterpret_cast<__vector signed char>(vec_splats(a4)); }
  // even and odd byte products (int16, k0+k1 and k2+k3 per column fit), then their halves.
  static VecI8 dot(VecI8 acc, A a, const int8_t* w) { return dotu(acc, loadw(reinterpret_cast<const uint8_t*>(w)), a); }
  // Weight bytes as int8 (codes of at most 63 for kernels/qdot.hpp, any int8 for dot()) times
  // signed activations: lane l += sum_j w[4l + j] * a[j].
  using W = __vector unsigned char;
  static W loadw(const uint8_t* p) { return vec_xl(0, p); }
  static void nibbles(W x, W& lo, W& hi) {
    lo = x & static_cast<unsigned char>(15);  // GNU vector operators: element-wise
    hi = x >> static_cast<unsigned char>(4);
  }
  // 5-bit codes: 16 added to the bytes of lo (hi) whose bit is set in bits[0, 2) ([2, 4)).
  static W bits16(const uint8_t* bits) {
    const unsigned char b0 = bits[0], b1 = bits[1];
    const W spread = {b0, b0, b0, b0, b0, b0, b0, b0, b1, b1, b1, b1, b1, b1, b1, b1};
    const W sel = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    return (W)vec_cmpeq(spread & sel, sel) & static_cast<unsigned char>(16);
  }
  static void high_bits(W& lo, W& hi, const uint8_t* bits) {
    lo = lo | bits16(bits);
    hi = hi | bits16(bits + 2);
  }
  // 6-bit codes (kernels/qdot.hpp): bits 4-5 of lo's (hi's) bytes from bits S, S + 1 (S + 2, S + 3)
  // of h's, S 0 or 4.
  template <int S>
  static void high_two(W& lo, W& hi, W h) {
    const unsigned char m = 0x30;
    lo = lo | ((S == 0 ? h << static_cast<unsigned char>(4) : h) & m);
    hi = hi | ((S == 0 ? h << static_cast<unsigned char>(2) : h >> static_cast<unsigned char>(2)) & m);
  }
  static A bcast_s(int32_t a4) { return bcast(a4); }
  static VecI8 dotu(VecI8 acc, W w, A a) {
    const __vector signed char wv = reinterpret_cast<__vector signed char>(w);
    const __vector signed short s = vec_mule(wv, a) + vec_mulo(wv, a);
    const __vector signed short one = vec_splats(static_cast<short>(1));
    return {acc.v + vec_mule(s, one) + vec_mulo(s, one)};
  }
  // 8-bit codes u = q + 128 (kernels/qdot.hpp): lane l += sum_j (u[4l + j] - 128) * a[j], exact:
  // q = u ^ 0x80 as int8 through dotu (even plus odd int16 products <= 2 * 128 * 127).
  static constexpr int kU8Bias = 0;
  using W8 = W;
  static W8 codes8(W u) { return u ^ static_cast<unsigned char>(0x80); }
  static VecI8 dotu8(VecI8 acc, W8 q, A a) { return dotu(acc, q, a); }
  static VecI8 zero() { return {vec_splats(0)}; }
  static VecI8 set1(int32_t x) { return {vec_splats(x)}; }
  void store(int32_t* p) const { vec_xst(v, 0, p); }
};

}  // namespace
}  // namespace cpuserve
