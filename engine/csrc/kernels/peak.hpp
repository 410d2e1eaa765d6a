// The arithmetic peak the GEMMs are held to (entrypoints/bench.py's compute bound): every thread
// runs kPeakChains independent multiply-add chains in registers, touching no memory, as FMAs on
// floats or, on the tables that multiply bfloat16 weights as pairs (vdpbf16ps), as bfloat16 pair
// dot products. Measured where the GEMMs run, on their own instructions: a GEMM's rate over this
// is its distance from the machine (torch's GEMM rate, the bound used before, is itself below it:
// on AMD EPYC Zen 4, 2 threads, torch's bfloat16 2,048^3 GEMM reached 416-423 GFLOP/s of the
// pair dot products' 462).
#pragma once
#include <cstdint>
#include <cstring>
#include <omp.h>
#include "../vec/vec.hpp"
#include "gemm.hpp"

namespace cpuserve {
namespace {

// Enough chains for two pipes of a 4-6 cycle latency, within the registers.
constexpr int kPeakChains = VecF::kRegs >= 32 ? 16 : 8;

template <typename T>
inline float madd_chains(int64_t steps) {
  VecF acc[kPeakChains];
  for (int c = 0; c < kPeakChains; ++c) acc[c] = VecF::set1(static_cast<float>(c));
  // 2^-10 as a float, or as a pair of bfloat16 (0x3a80 each): the sums stay normal numbers
  const uint32_t bits = std::is_same_v<T, float> ? 0x3a800000u : 0x3a803a80u;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  const VecF a = VecF::set1(x), b = VecF::set1(x);
  for (int64_t s = 0; s < steps; ++s)
    for (int c = 0; c < kPeakChains; ++c) acc[c] = Madd<T>::apply(a, b, acc[c]);
  VecF sum = acc[0];
  for (int c = 1; c < kPeakChains; ++c) sum = sum + acc[c];
  return sum.reduce_sum();
}

// FLOPs done by `steps` steps of every thread's chains, counted as the GEMMs count theirs (a
// multiply-add of two numbers is 2, a pair dot product 4); -1 for pairs on a table without them.
double peak_flops_impl(bool pairs, int64_t steps) {
  if (pairs && !kBf16Pairs) return -1.0;  // (gemm.hpp: whether this table's bfloat16 GEMMs multiply pairs)
  float sink = 0.f;
  int threads = 1;
#pragma omp parallel reduction(+ : sink)
  {
#pragma omp single
    threads = omp_get_num_threads();
    sink += pairs ? madd_chains<bf16x2>(steps) : madd_chains<float>(steps);
  }
  volatile float keep = sink;
  (void)keep;
  return static_cast<double>(steps) * kPeakChains * VecF::N * (pairs ? 4 : 2) * threads;
}

}  // namespace
}  // namespace cpuserve
