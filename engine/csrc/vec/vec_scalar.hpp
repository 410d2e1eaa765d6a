// Portable fallback: a fixed-width array of floats. Compilers auto-vectorise
// the loops for the baseline ISA; this path is also the reference the vector
// paths are tested against in the C++ kernel tests.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include "../dtype.hpp"

namespace cpuserve {
namespace {  // internal linkage: every ISA unit has its own copy

struct VecF {
  static constexpr int N = 8;
  static constexpr int kRegs = 16;  // vector registers the ISA has (micro-kernel blocking)
  static constexpr const char* kIsa = "scalar";
  float v[N];

  static VecF zero() { return set1(0.f); }
  static VecF set1(float x) { VecF r; for (int i = 0; i < N; ++i) r.v[i] = x; return r; }
  template <typename T> static VecF load(const T* p) {
    VecF r;
    for (int i = 0; i < N; ++i) r.v[i] = to_float(p[i]);
    return r;
  }
  // Lanes i: half h of the bfloat16 pair p[i] (h = 0: the value at the lower address, 1: the
  // other) as float32: a paired bfloat16 cache's row (kernels/cache.hpp) widened in registers.
  static VecF widen_half(const bf16x2* p, int h) {
    VecF r;
    const bf16* e = reinterpret_cast<const bf16*>(p);
    for (int i = 0; i < N; ++i) r.v[i] = to_float(e[2 * i + h]);
    return r;
  }
  static VecF i32(const int32_t* p) {
    VecF r;
    for (int i = 0; i < N; ++i) r.v[i] = static_cast<float>(p[i]);
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
  template <typename T> void store(T* p) const {
    for (int i = 0; i < N; ++i) p[i] = from_float<T>(v[i]);
  }
  friend VecF operator+(VecF a, VecF b) { for (int i = 0; i < N; ++i) a.v[i] += b.v[i]; return a; }
  friend VecF operator-(VecF a, VecF b) { for (int i = 0; i < N; ++i) a.v[i] -= b.v[i]; return a; }
  friend VecF operator*(VecF a, VecF b) { for (int i = 0; i < N; ++i) a.v[i] *= b.v[i]; return a; }
  friend VecF operator/(VecF a, VecF b) { for (int i = 0; i < N; ++i) a.v[i] /= b.v[i]; return a; }
  static VecF fma(VecF a, VecF b, VecF c) {
    for (int i = 0; i < N; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return c;
  }
  static VecF max(VecF a, VecF b) { for (int i = 0; i < N; ++i) a.v[i] = std::max(a.v[i], b.v[i]); return a; }
  float reduce_sum() const { float s = 0.f; for (int i = 0; i < N; ++i) s += v[i]; return s; }
  float reduce_max() const { float m = v[0]; for (int i = 1; i < N; ++i) m = std::max(m, v[i]); return m; }
  VecF exp() const { VecF r; for (int i = 0; i < N; ++i) r.v[i] = std::exp(v[i]); return r; }
};

// int8 dot products for the W8A8 GEMM (kernels/int8.hpp). A weight vector holds L columns x 4
// consecutive k as int8 ([-128, 127]); an activation broadcast holds 4 int8 in [-127, 127].
// dot(): lane l += sum_j a[j] * w[4l + j], exact in int32. kOffset: the activation bytes are
// fed as unsigned a + kOffset, so the caller subtracts kOffset * (the column's weight sum).
struct VecI8 {
  static constexpr int L = 4;
  static constexpr int kOffset = 0;
  int32_t v[L];
  struct A { int8_t b[4]; };
  static A bcast(int32_t a4) { A a; std::memcpy(a.b, &a4, 4); return a; }
  static VecI8 dot(VecI8 acc, A a, const int8_t* w) {
    for (int l = 0; l < L; ++l)
      for (int j = 0; j < 4; ++j) acc.v[l] += int32_t(a.b[j]) * int32_t(w[4 * l + j]);
    return acc;
  }
  // Unsigned weight codes times signed activations (kernels/qdot.hpp): lane l += sum_j w[4l + j] * a[j].
  struct W { uint8_t b[4 * L]; };
  static W loadw(const uint8_t* p) { W w; std::memcpy(w.b, p, sizeof(w.b)); return w; }
  static void nibbles(W x, W& lo, W& hi) {
    for (int i = 0; i < 4 * L; ++i) { lo.b[i] = x.b[i] & 15; hi.b[i] = x.b[i] >> 4; }
  }
  // 5-bit codes: 16 added to the bytes of lo (hi) whose bit is set in bits[0, L / 2) ([L / 2, L)).
  static void high_bits(W& lo, W& hi, const uint8_t* bits) {
    for (int i = 0; i < 4 * L; ++i) {
      if ((bits[i / 8] >> (i % 8)) & 1) lo.b[i] |= 16;
      if ((bits[L / 2 + i / 8] >> (i % 8)) & 1) hi.b[i] |= 16;
    }
  }
  // 6-bit codes (kernels/qdot.hpp): bits 4-5 of lo's (hi's) bytes from bits S, S + 1 (S + 2, S + 3)
  // of h's, S 0 or 4.
  template <int S>
  static void high_two(W& lo, W& hi, const W& h) {
    for (int i = 0; i < 4 * L; ++i) {
      lo.b[i] |= static_cast<uint8_t>(((h.b[i] >> S) & 3) << 4);
      hi.b[i] |= static_cast<uint8_t>(((h.b[i] >> (S + 2)) & 3) << 4);
    }
  }
  static A bcast_s(int32_t a4) { return bcast(a4); }
  static VecI8 dotu(VecI8 acc, const W& w, A a) {
    for (int l = 0; l < L; ++l)
      for (int j = 0; j < 4; ++j) acc.v[l] += int32_t(a.b[j]) * int32_t(w.b[4 * l + j]);
    return acc;
  }
  // 8-bit codes u = q + 128 (kernels/qdot.hpp): lane l += sum_j (u[4l + j] - 128) * a[j].
  static constexpr int kU8Bias = 0;
  using W8 = W;
  static W8 codes8(const W& u) { return u; }
  static VecI8 dotu8(VecI8 acc, const W8& w, A a) {
    for (int l = 0; l < L; ++l)
      for (int j = 0; j < 4; ++j) acc.v[l] += int32_t(a.b[j]) * (int32_t(w.b[4 * l + j]) - 128);
    return acc;
  }
  static VecI8 zero() { VecI8 r; for (int l = 0; l < L; ++l) r.v[l] = 0; return r; }
  static VecI8 set1(int32_t x) { VecI8 r; for (int l = 0; l < L; ++l) r.v[l] = x; return r; }
  void store(int32_t* p) const { std::memcpy(p, v, sizeof(v)); }
};

}  // namespace
}  // namespace cpuserve
