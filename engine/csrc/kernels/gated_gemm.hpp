// The gated MLP's first half in one pass: act[M, F] = silu(A @ Wg^T) * (A @ Wu^T), where the
// gate and up projections are one packed [2F, K] weight (gate rows first, as the model's merged
// gate_up). Each thread takes gate panel j and up panel j together (F a multiple of the panel
// width) and applies SiLU-and-mul to the pair's outputs while they are still in its L1 / L2,
// instead of writing the [M, 2F] projection out and reading it back in a second parallel pass.
//
// The same bits as gemm() followed by silu_and_mul(): every projection element is gemm's one
// fused multiply-add chain over k (continued across K blocks through the scratch), and
// silu_mul_row treats each element on its own.
#pragma once
#include <algorithm>
#include <vector>
#include <omp.h>
#include "activation.hpp"
#include "gemm.hpp"

namespace cpuserve {
namespace {

// Panels of a decode step's pair group: micro_rows runs 1-row decode 4 panels at a time.
constexpr int64_t kGatedDecodePairs = 4;

// Rows [m0, m1) of pairs [j, j + np) (np panels of gate, then np of up), K from 0 to k, into
// `buf` (rows x 2 * np * kNR: gate columns, then up); pf(half, k0, kc) is the chunk after a
// half's, fetched into L2 along the way where gemm_t would fetch it.
template <typename T, typename TA, typename PF>
inline void gated_chunk(const TA* a, int64_t lda, const T* w, int64_t k, int64_t kc_max, int64_t m0, int64_t m1,
                        int64_t j, int64_t np, int64_t up, float* buf, PF&& pf) {
  const int64_t ps = k * kNR, ld = 2 * np * kNR;
  for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
    const int64_t kc = std::min(kc_max, k - k0);
    for (int half = 0; half < 2; ++half) {
      const T* wp = w + (j + half * up) * ps;  // np panels from here, as panels [0, np)
      float* c = buf + half * np * kNR;
      if (m1 - m0 <= kPassRows) {  // more than kMR rows fetch each next panel (micro_rows), this group's last too
        const Prefetch next = m1 - m0 > kMR ? pf(half, k0, kc) : Prefetch{};
        micro_rows(static_cast<int>(m1 - m0), a + m0 * lda + k0, lda, wp, k, k0, kc, c, ld, 0, np, np * kNR, k0 == 0,
                   next);
        continue;
      }
      const int64_t tiles = (m1 - m0 + kMR - 1) / kMR;
      const Prefetch next = tiles > 1 ? pf(half, k0, kc) : Prefetch{};  // as gemm_t
      for (int64_t r = m0, t = 0; r < m1; r += kMR, ++t)
        micro_rows(static_cast<int>(std::min<int64_t>(kMR, m1 - r)), a + r * lda + k0, lda, wp, k, k0, kc,
                   c + (r - m0) * ld, ld, 0, 1, kNR, k0 == 0, next.slice(t, tiles));
    }
  }
}

// k counts elements of T (k pairs for bf16x2); f % kNR == 0.
template <typename T, typename TA = AOf<T>>
void gemm_silu_t(float* act, const TA* a, const T* w, int64_t m, int64_t f, int64_t k, int64_t lda, int64_t ldo) {
  const int64_t pairs = f / kNR;
  // row tiles and thread shares as gemm_t's, counted in pairs of panels
  const int64_t m_tiles = row_tiles(m, 2 * pairs);
  const int64_t mc = ((m + m_tiles - 1) / m_tiles + kMR - 1) / kMR * kMR;
  const int64_t per_group = (pairs + omp_get_max_threads() - 1) / omp_get_max_threads();
  const int64_t groups = (pairs + per_group - 1) / per_group;
  const int64_t kc_max = m <= 2 ? k : k_block<T>(k);
  const int64_t ps = k * kNR;
#pragma omp parallel for schedule(static) collapse(2) if (2 * m * f * k > 32768)
  for (int64_t mt = 0; mt < m_tiles; ++mt) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t m0 = mt * mc, m1 = std::min(m, m0 + mc);
      if (m0 >= m) continue;
      const int64_t j0 = g * per_group, j1 = std::min(pairs, j0 + per_group);
      const int64_t step = m1 - m0 <= kPassRows ? kGatedDecodePairs : 1;
      static thread_local std::vector<float> scratch;
      scratch.resize(static_cast<size_t>((m1 - m0) * 2 * step * kNR));
      for (int64_t j = j0; j < j1; j += step) {
        const int64_t np = std::min(step, j1 - j);
        // the chunk after this half's (up after gate, then the next K block or pair group)
        auto next = [&](int half, int64_t k0, int64_t kc) {
          int64_t panel = j + pairs, at = k0;
          if (half == 1) {
            panel = k0 + kc < k ? j : j + np;
            at = k0 + kc < k ? k0 + kc : 0;
            if (panel >= j1) return Prefetch{};
          }
          const int64_t len = std::min(kc_max, k - at);
          return Prefetch::bytes(w + panel * ps + at * kNR, static_cast<int64_t>(len * kNR * sizeof(T)));
        };
        gated_chunk(a, lda, w, k, kc_max, m0, m1, j, np, pairs, scratch.data(), next);
        const int64_t ld = 2 * np * kNR;
        for (int64_t r = m0; r < m1; ++r) {
          const float* row = scratch.data() + (r - m0) * ld;
          silu_mul_row(act + r * ldo + j * kNR, row, row + np * kNR, np * kNR);
        }
      }
    }
  }
}

// act[M, F] = silu(A W[0:F]^T) * (A W[F:2F]^T) for a weight packed by pack_weight_impl as [2F, K].
// F not a multiple of the panel width: the projection into a buffer, then silu_and_mul.
void gemm_silu_impl(float* act, const float* a, const void* w, DType dt, int64_t m, int64_t f, int64_t k,
                    int64_t lda, int64_t ldo) {
  if (f % kNR != 0) {
    static thread_local std::vector<float> proj;
    proj.resize(static_cast<size_t>(m * 2 * f));
    gemm_impl(proj.data(), a, w, dt, nullptr, m, 2 * f, k, lda, 2 * f);
    return silu_and_mul_impl(act, proj.data(), m, f, 2 * f, ldo);
  }
#ifdef __AVX512BF16__
  if (dt == DType::BF16) {
    const int64_t k2 = (k + 1) / 2;
    return gemm_silu_t(act, bf16_pairs_of(a, m, k, lda), static_cast<const bf16x2*>(w), m, f, k2, k2, ldo);
  }
#endif
  switch (dt) {
    case DType::F32: return gemm_silu_t(act, a, static_cast<const float*>(w), m, f, k, lda, ldo);
    case DType::BF16: return gemm_silu_t(act, a, static_cast<const bf16*>(w), m, f, k, lda, ldo);
    case DType::F16: return gemm_silu_t(act, a, static_cast<const f16*>(w), m, f, k, lda, ldo);
  }
}

}  // namespace
}  // namespace cpuserve
