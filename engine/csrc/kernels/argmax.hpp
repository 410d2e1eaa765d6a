// Greedy sampling's argmax over each row of logits, with torch.argmax's answer: the first index
// of the largest value, a NaN counting as the largest (the first NaN wins), index 0 for a row of
// -inf. torch's CPU argmax walks a 49,152-token row in ~14 us on one thread (64 rows: 0.9 ms of
// a decode step); this one takes each row a block of floats at a time in vectors, rows shared
// among the threads.
#pragma once
#include <cmath>
#include "../vec/vec.hpp"

namespace cpuserve {
namespace {

constexpr int64_t kArgmaxBlock = 16 * VecF::N;

// The exact rule, one element at a time from the best so far (v at index idx).
inline void argmax_scan(const float* x, int64_t lo, int64_t hi, float& v, int64_t& idx) {
  for (int64_t i = lo; i < hi; ++i)
    if (x[i] > v || (x[i] != x[i] && v == v)) v = x[i], idx = i;
}

// The largest value of x[0, n) (n a multiple of 2 vectors) and the sum of its values: a finite sum
// says there is no NaN or infinity (nor a sum that overflows), so the vector max is exact.
inline float block_max(const float* x, int64_t n, float& sum) {
  VecF m0 = VecF::load(x), m1 = VecF::load(x + VecF::N), s0 = m0, s1 = m1;
  for (int64_t i = 2 * VecF::N; i < n; i += 2 * VecF::N) {
    const VecF a = VecF::load(x + i), b = VecF::load(x + i + VecF::N);
    m0 = VecF::max(m0, a);
    m1 = VecF::max(m1, b);
    s0 = s0 + a;
    s1 = s1 + b;
  }
  sum = (s0 + s1).reduce_sum();
  return VecF::max(m0, m1).reduce_max();
}

inline int64_t argmax_row(const float* x, int64_t n) {
  float v = -INFINITY;
  int64_t idx = 0, i = 0;
  for (; i + kArgmaxBlock <= n; i += kArgmaxBlock) {
    float sum;
    const float m = block_max(x + i, kArgmaxBlock, sum);
    if (!std::isfinite(sum)) {
      argmax_scan(x, i, i + kArgmaxBlock, v, idx);  // a NaN, an infinity, or an overflowing sum
    } else if (m > v && v == v) {
      int64_t j = i;
      while (x[j] != m) ++j;
      v = m, idx = j;
    }
  }
  argmax_scan(x, i, n, v, idx);
  return idx;
}

// out[r] = argmax of x[r, 0:n) (rows x_stride floats apart).
void argmax_impl(int64_t* out, const float* x, int64_t rows, int64_t n, int64_t x_stride) {
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * x_stride, n);
}

}  // namespace
}  // namespace cpuserve
