// RMSNorm and RMSNorm with the residual add fused in.
#pragma once
#include <cmath>
#include "../vec/vec.hpp"

namespace cpuserve {
namespace {

inline float sum_squares(const float* x, int64_t dim) {
  VecF acc = VecF::zero();
  int64_t i = 0;
  for (; i + VecF::N <= dim; i += VecF::N) {
    VecF v = VecF::load(x + i);
    acc = VecF::fma(v, v, acc);
  }
  float s = acc.reduce_sum();
  for (; i < dim; ++i) s = std::fma(x[i], x[i], s);
  return s;
}

inline void scale_by_weight(float* out, const float* x, const float* w, int64_t dim, float inv) {
  const VecF vinv = VecF::set1(inv);
  int64_t i = 0;
  for (; i + VecF::N <= dim; i += VecF::N)
    (VecF::load(x + i) * vinv * VecF::load(w + i)).store(out + i);
  for (; i < dim; ++i) out[i] = x[i] * inv * w[i];
}

void rms_norm_impl(float* out, const float* x, const float* w, int64_t rows, int64_t dim,
                   int64_t x_stride, int64_t out_stride, float eps) {
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    const float inv = 1.f / std::sqrt(sum_squares(xr, dim) / static_cast<float>(dim) + eps);
    scale_by_weight(out + r * out_stride, xr, w, dim, inv);
  }
}

void fused_add_rms_norm_impl(float* x, float* residual, const float* w, int64_t rows, int64_t dim,
                             int64_t x_stride, int64_t res_stride, float eps) {
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * x_stride;
    float* rr = residual + r * res_stride;
    int64_t i = 0;
    for (; i + VecF::N <= dim; i += VecF::N) (VecF::load(xr + i) + VecF::load(rr + i)).store(rr + i);
    for (; i < dim; ++i) rr[i] = xr[i] + rr[i];
    const float inv = 1.f / std::sqrt(sum_squares(rr, dim) / static_cast<float>(dim) + eps);
    scale_by_weight(xr, rr, w, dim, inv);
  }
}

}  // namespace
}  // namespace cpuserve
