// Dense GEMM with packed weights: C[M, N] = A[M, K] @ W^T (+ bias), A and C
// float32, W float32, bfloat16 or float16. Weights are packed once at load time
// into panels of NR = 2 vectors of columns, K-major, so the micro-kernel streams
// one contiguous panel; narrow weights are widened to float32 in registers, so
// bfloat16 halves the memory traffic of decode without a slow bf16 path.
//
// Batch invariance: each C element is a single fused multiply-add chain over k
// in increasing order (continued across K blocks through C), whatever the
// micro-kernel height, the M tiling or the thread count.
#pragma once
#include <algorithm>
#include <cstring>
#include "../vec/vec.hpp"

namespace cpuserve {
namespace {

constexpr int kNR = 2 * VecF::N;
constexpr int kMR = 6;
constexpr int64_t kKC = 384;   // K block: an NR-wide panel chunk stays in L1
constexpr int64_t kMC = 48;    // rows of A per work item (8 micro-tiles)

template <typename T>
void pack_weight_t(T* dst, const T* src, int64_t n, int64_t k) {
  const int64_t panels = (n + kNR - 1) / kNR;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    T* out = dst + p * k * kNR;
    for (int64_t kk = 0; kk < k; ++kk)
      for (int j = 0; j < kNR; ++j) {
        const int64_t col = p * kNR + j;
        out[kk * kNR + j] = col < n ? src[col * k + kk] : T{};
      }
  }
}

void pack_weight_impl(void* dst, const void* src, DType dt, int64_t n, int64_t k) {
  switch (dt) {
    case DType::F32: return pack_weight_t(static_cast<float*>(dst), static_cast<const float*>(src), n, k);
    case DType::BF16: return pack_weight_t(static_cast<bf16*>(dst), static_cast<const bf16*>(src), n, k);
    case DType::F16: return pack_weight_t(static_cast<f16*>(dst), static_cast<const f16*>(src), n, k);
  }
}

// MR x NR micro-kernel over one K block. `first` starts the chain at zero,
// otherwise it continues from C. `cols` < NR only in the last (padded) panel.
template <int MR, typename T>
inline void micro_kernel(const float* a, int64_t lda, const T* b, int64_t kc, float* c, int64_t ldc,
                         bool first, int cols) {
  VecF acc0[MR], acc1[MR];
  alignas(64) float tmp[kNR];
  for (int r = 0; r < MR; ++r) {
    if (first) {
      acc0[r] = VecF::zero();
      acc1[r] = VecF::zero();
    } else if (cols == kNR) {
      acc0[r] = VecF::load(c + r * ldc);
      acc1[r] = VecF::load(c + r * ldc + VecF::N);
    } else {
      std::memset(tmp, 0, sizeof(tmp));
      std::memcpy(tmp, c + r * ldc, sizeof(float) * cols);
      acc0[r] = VecF::load(tmp);
      acc1[r] = VecF::load(tmp + VecF::N);
    }
  }
  for (int64_t kk = 0; kk < kc; ++kk) {
    const VecF b0 = VecF::load(b + kk * kNR);
    const VecF b1 = VecF::load(b + kk * kNR + VecF::N);
    for (int r = 0; r < MR; ++r) {
      const VecF av = VecF::set1(a[r * lda + kk]);
      acc0[r] = VecF::fma(av, b0, acc0[r]);
      acc1[r] = VecF::fma(av, b1, acc1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    if (cols == kNR) {
      acc0[r].store(c + r * ldc);
      acc1[r].store(c + r * ldc + VecF::N);
    } else {
      acc0[r].store(tmp);
      acc1[r].store(tmp + VecF::N);
      std::memcpy(c + r * ldc, tmp, sizeof(float) * cols);
    }
  }
}

template <typename T>
inline void micro_dispatch(int mr, const float* a, int64_t lda, const T* b, int64_t kc, float* c,
                           int64_t ldc, bool first, int cols) {
  switch (mr) {
    case 6: return micro_kernel<6>(a, lda, b, kc, c, ldc, first, cols);
    case 5: return micro_kernel<5>(a, lda, b, kc, c, ldc, first, cols);
    case 4: return micro_kernel<4>(a, lda, b, kc, c, ldc, first, cols);
    case 3: return micro_kernel<3>(a, lda, b, kc, c, ldc, first, cols);
    case 2: return micro_kernel<2>(a, lda, b, kc, c, ldc, first, cols);
    default: return micro_kernel<1>(a, lda, b, kc, c, ldc, first, cols);
  }
}

template <typename T>
void gemm_t(float* c, const float* a, const T* w, const float* bias, int64_t m, int64_t n, int64_t k,
            int64_t lda, int64_t ldc) {
  const int64_t panels = (n + kNR - 1) / kNR;
  const int64_t m_tiles = (m + kMC - 1) / kMC;
  // Enough panel groups to keep every thread busy, few enough to reuse A from L2.
  const int64_t per_group = std::max<int64_t>(1, std::min<int64_t>(8, panels * m_tiles / 64));
  const int64_t groups = (panels + per_group - 1) / per_group;
#pragma omp parallel for schedule(static) collapse(2) if (m * n * k > 32768)
  for (int64_t mt = 0; mt < m_tiles; ++mt) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t m0 = mt * kMC, m1 = std::min(m, m0 + kMC);
      const int64_t p0 = g * per_group, p1 = std::min(panels, p0 + per_group);
      for (int64_t k0 = 0; k0 < k; k0 += kKC) {
        const int64_t kc = std::min(kKC, k - k0);
        for (int64_t p = p0; p < p1; ++p) {
          const T* bp = w + p * k * kNR + k0 * kNR;
          const int cols = static_cast<int>(std::min<int64_t>(kNR, n - p * kNR));
          for (int64_t r = m0; r < m1; r += kMR) {
            const int mr = static_cast<int>(std::min<int64_t>(kMR, m1 - r));
            micro_dispatch(mr, a + r * lda + k0, lda, bp, kc, c + r * ldc + p * kNR, ldc, k0 == 0, cols);
          }
        }
      }
      if (bias != nullptr)
        for (int64_t r = m0; r < m1; ++r)
          for (int64_t col = p0 * kNR; col < std::min(n, p1 * kNR); ++col) c[r * ldc + col] += bias[col];
    }
  }
}

void gemm_impl(float* c, const float* a, const void* w, DType dt, const float* bias, int64_t m,
               int64_t n, int64_t k, int64_t lda, int64_t ldc) {
  switch (dt) {
    case DType::F32: return gemm_t(c, a, static_cast<const float*>(w), bias, m, n, k, lda, ldc);
    case DType::BF16: return gemm_t(c, a, static_cast<const bf16*>(w), bias, m, n, k, lda, ldc);
    case DType::F16: return gemm_t(c, a, static_cast<const f16*>(w), bias, m, n, k, lda, ldc);
  }
}

}  // namespace
}  // namespace cpuserve
