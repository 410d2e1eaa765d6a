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
