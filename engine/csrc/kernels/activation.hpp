// Gated activations: SiLU-and-mul (Llama MLP) and GELU-and-mul (Gemma MLP).
#pragma once
#include <cmath>
#include "../vec/vec.hpp"

namespace cpuserve {
namespace {

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

inline float gelu(float x, bool tanh_approx) {
  if (tanh_approx) {
    const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.f + std::tanh(inner));
  }
  return 0.5f * x * (1.f + std::erf(x * 0.7071067811865476f));
}

// o[i] = silu(g[i]) * u[i] for i < d: each element on its own, so a row computed in pieces (the
// fused gate/up GEMM, kernels/gated_gemm.hpp) gets the same bits as a whole one.
inline void silu_mul_row(float* o, const float* g, const float* u, int64_t d) {
  const VecF one = VecF::set1(1.f), zero = VecF::zero();
  int64_t i = 0;
  for (; i + VecF::N <= d; i += VecF::N) {
    VecF gv = VecF::load(g + i);
    // silu(g) = g / (1 + exp(-g)); the vector exp is accurate to ~1 ulp.
    ((gv * VecF::load(u + i)) / (one + (zero - gv).exp())).store(o + i);
  }
  for (; i < d; ++i) o[i] = silu(g[i]) * u[i];
}

void silu_and_mul_impl(float* out, const float* x, int64_t tokens, int64_t d, int64_t x_stride,
                       int64_t out_stride) {
#pragma omp parallel for schedule(static) if (tokens * d > 4096)
  for (int64_t t = 0; t < tokens; ++t) silu_mul_row(out + t * out_stride, x + t * x_stride, x + t * x_stride + d, d);
}

void gelu_and_mul_impl(float* out, const float* x, int64_t tokens, int64_t d, int64_t x_stride,
                       int64_t out_stride, bool tanh_approx) {
#pragma omp parallel for schedule(static) if (tokens * d > 4096)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* g = x + t * x_stride;
    const float* u = g + d;
    float* o = out + t * out_stride;
    for (int64_t i = 0; i < d; ++i) o[i] = gelu(g[i], tanh_approx) * u[i];
  }
}

}  // namespace
}  // namespace cpuserve
