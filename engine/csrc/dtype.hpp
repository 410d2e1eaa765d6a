// Scalar storage types and their conversions to and from float.
// Activations are always float32; weights and the KV cache may be stored as
// bfloat16 or float16 and are widened to float32 inside the kernels.
#pragma once
#include <array>
#include <cstdint>
#include <cstring>

namespace cpuserve {

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2, F8E5M2 = 3, F8E4M3 = 4 };

struct bf16 { uint16_t bits; };
// Two bfloat16 of consecutive k, low half first: the operand of a bf16 pair dot product.
struct bf16x2 { uint32_t bits; };
// The same pair as a weight whose halves are widened to float32 in registers (VecF::widen_pair) and
// multiplied by float32 activations taken two at a time (f32x2): one FMA chain per output, k then
// k + 1, the bits of the one-at-a-time path at half its widening work.
struct bf16p { uint32_t bits; };
struct f32x2 { float v[2]; };
struct f16 { uint16_t bits; };
// KV cache only: OCP float8, torch's float8_e5m2 and float8_e4m3fn.
struct f8e5m2 { uint8_t bits; };
struct f8e4m3 { uint8_t bits; };

// Conversions have internal linkage: each ISA unit is compiled with its own
// flags, and an inline function shared between them could run AVX code on a
// CPU without it.
namespace {

// Calls f with a null pointer of the KV cache element type `dt` names, a type tag for the kernels
// templated on it (f(static_cast<T*>(nullptr))): every cache type the engine allocates.
template <typename F> void with_cache_type(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: return f(static_cast<float*>(nullptr));
    case DType::BF16: return f(static_cast<bf16*>(nullptr));
    case DType::F16: return f(static_cast<f16*>(nullptr));
    case DType::F8E5M2: return f(static_cast<f8e5m2*>(nullptr));
    case DType::F8E4M3: return f(static_cast<f8e4m3*>(nullptr));
  }
}

inline float to_float(float x) { return x; }

inline float to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float to_float(f16 h) {
  const uint32_t sign = (h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1f;
  uint32_t mant = h.bits & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) { mant <<= 1; --exp; }
      mant &= 0x3ffu;
      u = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// e5m2 is float16 without its low byte.
inline float to_float(f8e5m2 x) { return to_float(f16{static_cast<uint16_t>(x.bits << 8)}); }

inline float to_float(f8e4m3 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x80u) << 24;
  const uint32_t e = (x.bits >> 3) & 0xfu, m = x.bits & 7u;
  float f;
  if (e == 0xf && m == 7) {
    const uint32_t nan = sign | 0x7fc00000u;
    std::memcpy(&f, &nan, 4);
    return f;
  }
  if (e == 0) {
    f = static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  } else {
    const uint32_t u = ((e + 120) << 23) | (m << 20);
    std::memcpy(&f, &u, 4);
  }
  return sign ? -f : f;
}

// All 256 e4m3 values, for table lookups in the vector loads.
inline const float* f8e4m3_table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> a{};
    for (int i = 0; i < 256; ++i) a[i] = to_float(f8e4m3{static_cast<uint8_t>(i)});
    return a;
  }();
  return t.data();
}

template <typename T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }

// Round to nearest even, NaN preserved (same as torch's conversion).
template <> inline bf16 from_float<bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

template <> inline f16 from_float<f16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return f16{static_cast<uint16_t>(sign | 0x7e00u)};  // NaN
  if (u >= 0x477ff000u) return f16{static_cast<uint16_t>(sign | 0x7c00u)};  // overflow -> inf
  if (u < 0x38800000u) {  // subnormal or zero in f16
    if (u < 0x33000000u) return f16{sign};
    const uint32_t e = u >> 23;
    const uint32_t m = (u & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14 - (e - 112)
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return f16{static_cast<uint16_t>(sign | r)};
  }
  uint32_t r = u - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return f16{static_cast<uint16_t>(sign | (r >> 13))};
}

// |x|'s bits u (finite, below the overflow threshold) rounded to nearest even into a float8 with
// `mbits` mantissa bits and exponent bias `bias`, as c10's Float8 conversions do: subnormal
// results are left to the float adder's rounding, normal ones rebias and round the bits.
inline uint8_t f8_round(uint32_t u, int mbits, int bias) {
  const int shift = 23 - mbits;
  if (u < (static_cast<uint32_t>(128 - bias) << 23)) {
    const uint32_t denorm = static_cast<uint32_t>(128 - bias + shift) << 23;
    float f, dm;
    std::memcpy(&f, &u, 4);
    std::memcpy(&dm, &denorm, 4);
    f += dm;
    std::memcpy(&u, &f, 4);
    return static_cast<uint8_t>(u - denorm);
  }
  u += (static_cast<uint32_t>(bias - 127) << 23) + ((1u << (shift - 1)) - 1u) + ((u >> shift) & 1u);
  return static_cast<uint8_t>(u >> shift);
}

// Round to nearest even as torch (c10's Float8_e5m2): beyond the range, inf; NaN kept.
template <> inline f8e5m2 from_float<f8e5m2>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  const uint8_t r = u >= (143u << 23) ? (u > 0x7f800000u ? 0x7f : 0x7c) : f8_round(u, 2, 15);
  return f8e5m2{static_cast<uint8_t>(r | (sign >> 24))};
}

// Round to nearest even as torch (c10's Float8_e4m3fn), but saturating at +-448 instead of
// NaN (a KV cache entry out of range keeps its sign and largest magnitude); NaN kept.
template <> inline f8e4m3 from_float<f8e4m3>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  // above 464 a value would round past 448
  const uint8_t r = u > 0x7f800000u ? 0x7f : u > 0x43e80000u ? 0x7e : f8_round(u, 3, 7);
  return f8e4m3{static_cast<uint8_t>(r | (sign >> 24))};
}

}  // namespace
}  // namespace cpuserve
