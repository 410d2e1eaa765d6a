// Rotary position embedding, NeoX (rotate halves) and GPT-J (rotate pairs) styles,
// applied in place to q and k; partial rotary (rot_dim < head_dim) leaves the rest.
#pragma once
#include "../vec/vec.hpp"

namespace cpuserve {
namespace {

inline void rotate_head(float* x, const float* cos, const float* sin, int64_t rot_dim, bool neox) {
  const int64_t half = rot_dim / 2;
  if (neox) {
    int64_t i = 0;
    for (; i + VecF::N <= half; i += VecF::N) {
      VecF x1 = VecF::load(x + i), x2 = VecF::load(x + half + i);
      VecF c = VecF::load(cos + i), s = VecF::load(sin + i);
      (x1 * c - x2 * s).store(x + i);
      (x2 * c + x1 * s).store(x + half + i);
    }
    for (; i < half; ++i) {
      const float x1 = x[i], x2 = x[half + i];
      x[i] = x1 * cos[i] - x2 * sin[i];
      x[half + i] = x2 * cos[i] + x1 * sin[i];
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[2 * i], x2 = x[2 * i + 1];
      x[2 * i] = x1 * cos[i] - x2 * sin[i];
      x[2 * i + 1] = x2 * cos[i] + x1 * sin[i];
    }
  }
}

void rotary_impl(float* q, float* k, const int64_t* positions, const float* cos_sin, int64_t tokens,
                 int64_t num_q_heads, int64_t num_k_heads, int64_t head_dim, int64_t rot_dim,
                 int64_t q_stride, int64_t k_stride, bool neox) {
#pragma omp parallel for schedule(static) if (tokens > 1)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cos = cos_sin + positions[t] * rot_dim;
    const float* sin = cos + rot_dim / 2;
    for (int64_t h = 0; h < num_q_heads; ++h) rotate_head(q + t * q_stride + h * head_dim, cos, sin, rot_dim, neox);
    if (k != nullptr)
      for (int64_t h = 0; h < num_k_heads; ++h) rotate_head(k + t * k_stride + h * head_dim, cos, sin, rot_dim, neox);
  }
}

}  // namespace
}  // namespace cpuserve
