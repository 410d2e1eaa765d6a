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
  static constexpr const char* kIsa = "vxe";
  __vector float v;

  static VecF zero() { return {vec_splats(0.f)}; }
  static VecF set1(float x) { return {vec_splats(x)}; }
  static VecF load(const float* p) { return {vec_xl(0, p)}; }
  static VecF load(const bf16* p) {
    __vector unsigned short h = vec_xl(0, reinterpret_cast<const unsigned short*>(p));
    __vector unsigned int w = vec_unpackh(h);  // first four elements, zero-extended
    // element-wise shift (vec_sll would shift the whole register)
    return {reinterpret_cast<__vector float>(w << 16)};
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

}  // namespace
}  // namespace cpuserve
