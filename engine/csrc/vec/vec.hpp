// Selects the vector type for the ISA this translation unit is compiled for.
// Each kernel is written once against VecF; isa_unit.cpp is compiled once per
// ISA with CPUSERVE_ISA_* defined and the matching compiler flags.
#pragma once
#if defined(CPUSERVE_ISA_AVX512) || defined(CPUSERVE_ISA_AVX512_VNNI) || defined(CPUSERVE_ISA_AVX512_BF16) || \
    defined(CPUSERVE_ISA_AMX)
#include "vec_avx512.hpp"
#elif defined(CPUSERVE_ISA_AVX2)
#include "vec_avx2.hpp"
#elif defined(CPUSERVE_ISA_NEON) || defined(CPUSERVE_ISA_NEON_DOTPROD)
#include "vec_neon.hpp"
#elif defined(CPUSERVE_ISA_VXE)
#include "vec_vxe.hpp"
#else
#include "vec_scalar.hpp"
#endif

#include <type_traits>

namespace cpuserve {
namespace {
// acc + a * b: one FMA, or for bf16 pairs one pair dot product (vdpbf16ps).
template <typename T> struct Madd {
  static VecF apply(VecF a, VecF b, VecF acc) { return VecF::fma(a, b, acc); }
};
#ifdef __AVX512BF16__
template <> struct Madd<bf16x2> {
  static VecF apply(VecF a, VecF b, VecF acc) { return VecF::dot2(a, b, acc); }
};
#endif

// The other operand's element for elements of type T: float, a bf16 pair for bf16 pairs, two
// floats for bf16 pairs widened in registers.
template <typename T>
using AOf = std::conditional_t<std::is_same_v<T, bf16x2>, bf16x2, std::conditional_t<std::is_same_v<T, bf16p>, f32x2, float>>;

// Whether this ISA's VecF widens bfloat16 weight pairs (VecF::widen_pair): its GEMMs then pack
// bfloat16 weights as pairs without rounding the activations (AVX2, and AVX-512 without BF16).
template <typename V, typename = void> struct WidensPairs : std::false_type {};
template <typename V>
struct WidensPairs<V, std::void_t<decltype(V::widen_pair(static_cast<const bf16p*>(nullptr), 0))>> : std::true_type {};

// Elements of T a micro-kernel step takes in k, and step h's weight vector at p and activation.
template <typename T> constexpr int kSubSteps = std::is_same_v<T, bf16p> ? 2 : 1;
template <typename T, typename V = VecF>
inline V weight_at(const T* p, [[maybe_unused]] int h) {
  if constexpr (std::is_same_v<T, bf16p>) return V::widen_pair(p, h);
  else return V::load(p);
}
inline float act_at(float x, int) { return x; }
inline bf16x2 act_at(bf16x2 x, int) { return x; }
inline float act_at(f32x2 x, int h) { return x.v[h]; }
}  // namespace
}  // namespace cpuserve
