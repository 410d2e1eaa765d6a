// Greedy decoding's token from a float32 LM head without computing every float32 logit: the
// argmax of x @ W^T, decided from the same product on a bfloat16 copy of W (`approx`, the bfloat16
// GEMM's output: half the bytes, and on CPUs with bfloat16 pair dot products twice the rate)
// with a proven bound on how far each approximate logit can be from the float32 one, and the few
// logits that bound cannot rule out computed in float32, exactly as the float32 GEMM computes
// them. The answer is torch.argmax of the float32 logits, bit for bit: the first index of the
// largest; where it cannot be decided (a non-finite value) the row is left to the caller (-1).
//
// The bound, for row x and column w (K of each), L = the float32 GEMM's logit (one FMA chain over
// k: K roundings of u = 2^-24) and A = the bfloat16 GEMM's (x and w rounded to bfloat16 to nearest,
// |rounding| <= b|value| with b = 2^-9, their products exact in float32, summed with at most K
// roundings; on CPUs without pair dot products x stays float32, which the bound also covers):
//   |L - x.w|  <= g S,   |A - x.w| <= (2b + b^2) S + g (1 + b)^2 S,   g = K u / (1 - K u),
// S = sum |x_k w_k| <= |x|_2 |w|_2 (Cauchy-Schwarz), so |A - L| <= c |x| |w| with
// c = 2b + b^2 + g (1 + (1 + b)^2); a denormal flushed to zero (pair dot products read and write
// none) adds at most 2^-126 a product, covered by an absolute slack s. Every float rounding of the
// test itself is accounted for too (greedy_row).
//
// Measured on the default model (SmolLM2-135M, float32, 1,024 decode rows of 16 random-prompt
// sequences): 1.6 candidates a row on average (median 1, 90th percentile 2, at most 36) of
// 49,152, the bound 0.69 at its median against 0.29 at most of actual difference.
//
// Any other copy of W whose GEMM takes float32 x (layers/embedding.py q8_0_copy: GGUF Q8_0
// blocks, a float16 scale to each 32 weights, the GEMM's products and sums in float32) gets its
// bound from norms the caller computes per column: with W'_t the copy's row as the GEMM reads it
// (the blocks dequantized exactly), |A - L| <= |A - x.W'_t| + |x.(W'_t - W_t)| + |x.W_t - L|
//   <= |x| (|W'_t - W_t| + g' (|W'_t| + |W_t|)),   g' = n u / (1 - n u),
// where n bounds the roundings a product meets on its way to A or L (a block's chain of 32, its
// scale, the sum over blocks: the caller takes n = 2K + 64). norms[t] >= that bracket, and the
// test below runs on E_t = |x| norms[t]. The default model's head, which its GGUF stores as Q8_0,
// is its own Q8_0 copy (the bracket its rounding terms only): 1.0 candidates a row, at most 2, on
// 1,008 decode rows; weights off the Q8_0 grid (noise of 5-100% of their spread added) 2.4-5.2 a
// row on average, at most 23-105.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#include "../vec/vec.hpp"

namespace cpuserve {
namespace {

constexpr int64_t kHeadBlock = 16 * VecF::N;  // a block of approximate logits tested at once

// What greedy_head's norms bound: |W_t| for a bfloat16 copy, or the copy's error per unit |x| (above).
enum GreedyBound : int { kBf16Copy = 0, kErrorNorms = 1 };

// c of the bound above for K-long dot products, with 1% to spare for the double arithmetic of |x|.
inline double greedy_bound_coefficient(int64_t k) {
  const double b = std::ldexp(1.0, -9), u = std::ldexp(1.0, -24), ku = static_cast<double>(k) * u;
  const double g = ku / (1.0 - ku);
  return (2 * b + b * b + g * (1 + (1 + b) * (1 + b))) * 1.01;
}

// Logit `col` of row x exactly as the float32 GEMM computes it from its panels (gemm.hpp: kNR
// columns a panel, K-major; each output one FMA chain over k in increasing order from zero).
inline float exact_logit(const float* x, const float* w, int64_t col, int64_t k) {
  const float* p = w + (col / kNR) * k * kNR + col % kNR;
  float acc = 0.f;
  for (int64_t kk = 0; kk < k; ++kk) acc = std::fma(x[kk], p[kk * kNR], acc);
  return acc;
}

// Row r's token, or -1. Proof sketch of the test: with E_t = ce * norms[t] >= c |x| |w_t| and
// Q = max|A| + ce * norm_max, every float lo_t = fl(A_t - E_t) and hi_t = fl(A_t + E_t) is within
// 2^-24 Q of its real value; thr = max lo. The largest float32 logit L* >= A_t - E_t - s for every
// t, so L* >= thr - 2^-24 Q - s; a column with hi_t < thr - 2^-22 Q - 2 s has L_t <= hi_t + 2^-24 Q
// + s < L*: it cannot be the argmax, nor tie with it. The rest are computed exactly.
inline int64_t greedy_row(const float* a, const float* x, const float* w, const float* norms, float norm_max,
                          GreedyBound bound, int64_t n, int64_t k, std::vector<float>& block_hi, float* tmp) {
  double xx = 0;
  for (int64_t i = 0; i < k; ++i) xx += static_cast<double>(x[i]) * x[i];
  const double xn = std::sqrt(xx) * (1 + 1e-12);
  const double ce_d = (bound == kBf16Copy ? greedy_bound_coefficient(k) : 1.0 + std::ldexp(1.0, -20)) * xn;
  if (!std::isfinite(ce_d) || ce_d > 1e30) return -1;
  const float ce = std::nextafter(static_cast<float>(ce_d), INFINITY);
  const double s = static_cast<double>(k + 2) * std::ldexp(1.0, -124) * (1 + xn) * (1 + norm_max);
  const VecF cev = VecF::set1(ce);
  const int64_t blocks = (n + kHeadBlock - 1) / kHeadBlock;
  block_hi.assign(static_cast<size_t>(blocks), -INFINITY);
  VecF lo_max = VecF::set1(-INFINITY), a_max = lo_max, neg_max = lo_max, sum = VecF::zero();
  const int64_t whole = n / VecF::N * VecF::N;
  for (int64_t b = 0; b * kHeadBlock < whole; ++b) {
    VecF hi_max = VecF::set1(-INFINITY);
    for (int64_t i = b * kHeadBlock; i < std::min(whole, (b + 1) * kHeadBlock); i += VecF::N) {
      const VecF av = VecF::load(a + i), ev = cev * VecF::load(norms + i);
      lo_max = VecF::max(lo_max, av - ev);
      hi_max = VecF::max(hi_max, av + ev);
      a_max = VecF::max(a_max, av);
      neg_max = VecF::max(neg_max, VecF::zero() - av);
      sum = sum + av;
    }
    block_hi[static_cast<size_t>(b)] = hi_max.reduce_max();
  }
  float lo = lo_max.reduce_max(), amax = std::max(a_max.reduce_max(), neg_max.reduce_max());
  double tail_sum = 0;
  for (int64_t i = whole; i < n; ++i) {  // the last columns (n not a multiple of a vector)
    const float e = ce * norms[i];
    lo = std::max(lo, a[i] - e);
    amax = std::max(amax, std::fabs(a[i]));
    tail_sum += a[i];
  }
  if (!std::isfinite(sum.reduce_sum()) || !std::isfinite(tail_sum) || !std::isfinite(amax) || !std::isfinite(lo))
    return -1;  // a NaN, an infinity, or logits too large for the sums: left to the float32 logits
  const double q = static_cast<double>(amax) + static_cast<double>(ce) * norm_max;
  const float thr = std::nextafter(static_cast<float>(lo - std::ldexp(q, -22) - 2 * s), -INFINITY);
  float best = -INFINITY;
  int64_t idx = -1;
  auto consider = [&](int64_t t) {
    const float l = exact_logit(x, w, t, k);
    if (!std::isfinite(l)) return false;
    if (l > best) best = l, idx = t;
    return true;
  };
  for (int64_t b = 0; b < blocks; ++b) {
    if (!(block_hi[static_cast<size_t>(b)] >= thr)) continue;
    const int64_t i0 = b * kHeadBlock, i1 = std::min(whole, i0 + kHeadBlock);
    for (int64_t i = i0; i < i1; i += VecF::N) {  // hi again, computed as above: the same floats
      (VecF::load(a + i) + cev * VecF::load(norms + i)).store(tmp);
      for (int j = 0; j < VecF::N; ++j)
        if (tmp[j] >= thr && !consider(i + j)) return -1;
    }
  }
  for (int64_t i = whole; i < n; ++i)
    if (a[i] + ce * norms[i] >= thr && !consider(i)) return -1;
  return idx;
}

// out[r] = the argmax of row r of x @ W^T, W [n, k] float32 in the GEMM's panels, decided from
// approx = x @ copy(W)^T (rows approx_stride apart) and norms (norm_max their largest): for
// bound = kBf16Copy a bfloat16 copy and norms[t] >= |W_t|_2, for kErrorNorms any copy and norms[t]
// >= its error bracket (above); -1 where undecided. Returns how many rows are undecided.
int64_t greedy_head_impl(int64_t* out, const float* approx, int64_t approx_stride, const float* x, int64_t x_stride,
                         const float* w, const float* norms, float norm_max, int bound, int64_t rows, int64_t n,
                         int64_t k) {
  int64_t undecided = 0;
#pragma omp parallel if (rows > 1) reduction(+ : undecided)
  {
    thread_local std::vector<float> block_hi;  // kept between calls: no allocation once warm
    alignas(64) float tmp[VecF::N];
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      out[r] = greedy_row(approx + r * approx_stride, x + r * x_stride, w, norms, norm_max,
                          static_cast<GreedyBound>(bound), n, k, block_hi, tmp);
      undecided += out[r] < 0;
    }
  }
  return undecided;
}

}  // namespace
}  // namespace cpuserve
