// The arithmetic peak the GEMMs are held to (entrypoints/bench.py's compute bound): every thread
// runs kPeakChains independent multiply-add chains in registers, touching no memory, as FMAs on
// floats or, on the tables that multiply bfloat16 weights as pairs (vdpbf16ps), as bfloat16 pair
// dot products, or on the amx table, whose bfloat16 GEMMs run on tiles, as tile dot products
// (tdpbf16ps into four independent accumulator tiles). Measured where the GEMMs run, on their own
// instructions: a GEMM's rate over this is its distance from the machine (torch's GEMM rate, the
// bound used before, is itself below it: on AMD EPYC Zen 4, 2 threads, torch's bfloat16 2,048^3
// GEMM reached 416-423 GFLOP/s of the pair dot products' 462). On the Xeon with AMX the pair dot
// products' peak (about 180 GFLOP/s on two cores) was half the FMAs' and a twentieth of the tiles'.
#pragma once
#include <cstdint>
#include <cstring>
#include <omp.h>
#include "../vec/vec.hpp"
#include "amx.hpp"
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

#ifdef __AMX_BF16__
// FLOPs of one tdpbf16ps on full tiles: 16 x 16 outputs, each 16 pair dot products (4 FLOPs each).
constexpr double kTileStepFlops = 16.0 * 16 * 16 * 4;
constexpr int kTileChains = 4;  // accumulator tiles 0-3, as amx_panel keeps them

// `steps` steps of four tile dot products into independent accumulators (A tiles 4-5, B tiles 6-7
// of bfloat16 2^-10 pairs); the accumulators' sum, so that nothing is optimized away.
inline float tile_chains(int64_t steps) {
  alignas(64) uint16_t ab[16 * 32];
  for (uint16_t& x : ab) x = 0x3a80;
  amx_configure(16, 16);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ab, 64);
  _tile_loadd(5, ab, 64);
  _tile_loadd(6, ab, 64);
  _tile_loadd(7, ab, 64);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[16 * 16];
  float sum = 0.f;
  _tile_stored(0, c, 64);
  sum += c[0];
  _tile_stored(3, c, 64);
  sum += c[255];
  _tile_release();
  return sum;
}
#endif

// FLOPs done by `steps` steps of every thread's chains, counted as the GEMMs count theirs (a
// multiply-add of two numbers is 2, a pair dot product 4; on the amx table a step of the bfloat16
// probe is four full tile dot products); -1 for pairs on a table without them.
double peak_flops_impl(bool pairs, int64_t steps) {
  if (pairs && !kBf16Pairs) return -1.0;  // (gemm.hpp: whether this table's bfloat16 GEMMs multiply pairs)
  float sink = 0.f;
  int threads = 1;
#pragma omp parallel reduction(+ : sink)
  {
#pragma omp single
    threads = omp_get_num_threads();
#ifdef __AMX_BF16__
    sink += pairs ? tile_chains(steps) : madd_chains<float>(steps);
#else
    sink += pairs ? madd_chains<bf16x2>(steps) : madd_chains<float>(steps);
#endif
  }
  volatile float keep = sink;
  (void)keep;
#ifdef __AMX_BF16__
  if (pairs) return static_cast<double>(steps) * kTileChains * kTileStepFlops * threads;
#endif
  return static_cast<double>(steps) * kPeakChains * VecF::N * (pairs ? 4 : 2) * threads;
}

}  // namespace
}  // namespace cpuserve
