// Selects the vector type for the ISA this translation unit is compiled for.
// Each kernel is written once against VecF; isa_unit.cpp is compiled once per
// ISA with CPUSERVE_ISA_* defined and the matching compiler flags.
#pragma once
#if defined(CPUSERVE_ISA_AVX512) || defined(CPUSERVE_ISA_AVX512_VNNI) || defined(CPUSERVE_ISA_AVX512_BF16)
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

// The other operand's element for elements of type T: float, or a bf16 pair for bf16 pairs.
template <typename T> using AOf = std::conditional_t<std::is_same_v<T, bf16x2>, bf16x2, float>;
}  // namespace
}  // namespace cpuserve
