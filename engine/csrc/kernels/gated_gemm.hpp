// The gated MLP's first half in one pass: act[M, F] = silu(A @ Wg^T) * (A @ Wu^T), where the
// gate and up projections are one packed [2F, K] weight (gate rows first, as the model's merged
// gate_up), dense (gemm.hpp), GGUF blocks on the float path (quant.hpp) or on int8 dot products
// (qdot.hpp), or W8A8 (int8.hpp). Each thread takes
// gate panel j and up panel j together (F a multiple of the panel width) and applies SiLU-and-mul
// to the pair's outputs while they are still in its L1 / L2, instead of writing the [M, 2F]
// projection out and reading it back in a second parallel pass.
//
// The same bits as gemm() (qgemm(), qdgemm(), i8gemm()) followed by silu_and_mul(): every
// projection element is the GEMM's one fused multiply-add chain over k (continued across K blocks
// through the scratch) or its exact integer sum and float epilogue, and silu_mul_row treats each
// element on its own.
#pragma once
#include <algorithm>
#include <vector>
#include <omp.h>
#include "activation.hpp"
#include "amx.hpp"
#include "gemm.hpp"
#include "int8.hpp"
#include "qdot.hpp"
#include "quant.hpp"

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
      const int64_t tr = tile_rows<T>(m1 - m0), tiles = (m1 - m0 + tr - 1) / tr;
      const Prefetch next = tiles > 1 && paces_prefetch<T>(tr) ? pf(half, k0, kc) : Prefetch{};  // as gemm_t
      for (int64_t r = m0, t = 0; r < m1; r += tr, ++t)
        micro_rows(static_cast<int>(std::min<int64_t>(tr, m1 - r)), a + r * lda + k0, lda, wp, k, k0, kc,
                   c + (r - m0) * ld, ld, 0, 1, kNR, k0 == 0, next.slice(t, tiles));
    }
  }
}

// k counts elements of T (k pairs for bf16x2 and bf16p); f % kNR == 0.
template <typename T, typename TA = AOf<T>>
void gemm_silu_t(float* act, const TA* a, const T* w, int64_t m, int64_t f, int64_t k, int64_t lda, int64_t ldo) {
  const int64_t pairs = f / kNR;
  // row tiles and thread shares (share_tiles) as gemm_t's, counted in pairs of panels
  const int64_t m_tiles = row_tiles(m, 2 * pairs);
  const int64_t mc = ((m + m_tiles - 1) / m_tiles + kMR - 1) / kMR * kMR;
  const int64_t kc_max = m <= 2 ? k : k_block<T>(k);
  const int64_t ps = k * kNR;
  const int64_t chunk = tile_chunk(mc <= kPassRows, kc_max == k, m_tiles * pairs);
  share_tiles(m_tiles, pairs, chunk, 2 * m * f * k > 32768, [&](int64_t mt, int64_t j0, int64_t j1) {
    const int64_t m0 = mt * mc, m1 = std::min(m, m0 + mc);
    if (m0 >= m) return;
    const int64_t step = m1 - m0 <= kPassRows ? kGatedDecodePairs : 1;
    static thread_local std::vector<float> scratch;
    scratch.resize(static_cast<size_t>((m1 - m0) * 2 * step * kNR));
    for (int64_t j = j0; j < j1; j += step) {
      const int64_t np = std::min(step, j1 - j);
      // the chunk after this half's (up after gate, then the next K block or pair: the owner's
      // next chunk, unless another thread takes it first)
      auto next = [&](int half, int64_t k0, int64_t kc) {
        int64_t panel = j + pairs, at = k0;
        if (half == 1) {
          panel = k0 + kc < k ? j : j + np;
          at = k0 + kc < k ? k0 + kc : 0;
          if (panel >= pairs) return Prefetch{};
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
  });
}

// Where F is no multiple of the panel width: the [M, 2F] projection into a buffer by gemm(buffer),
// then silu_and_mul.
template <typename Gemm>
void silu_after(float* act, int64_t m, int64_t f, int64_t ldo, Gemm&& gemm) {
  static thread_local std::vector<float> proj;
  proj.resize(static_cast<size_t>(m * 2 * f));
  gemm(proj.data());
  silu_and_mul_impl(act, proj.data(), m, f, 2 * f, ldo);
}

// act[M, F] = silu(A W[0:F]^T) * (A W[F:2F]^T) for a weight packed by pack_weight_impl as [2F, K].
void gemm_silu_impl(float* act, const float* a, const void* w, DType dt, int64_t m, int64_t f, int64_t k,
                    int64_t lda, int64_t ldo) {
  if (f % kNR != 0)
    return silu_after(act, m, f, ldo,
                      [&](float* proj) { gemm_impl(proj, a, w, dt, nullptr, m, 2 * f, k, lda, 2 * f); });
#ifdef __AMX_BF16__
  if (dt == DType::BF16) return amx_gemm_silu(act, a, static_cast<const bf16x2*>(w), m, f, k, lda, ldo);
#elif defined(__AVX512BF16__)
  if (dt == DType::BF16) {
    const int64_t k2 = (k + 1) / 2;
    return gemm_silu_t(act, bf16_pairs_of(a, m, k, lda, k2), static_cast<const bf16x2*>(w), m, f, k2, k2, ldo);
  }
#endif
  if (dt == DType::BF16 && run_widened_pairs(a, m, k, lda, w, [&](auto a2, int64_t k2, int64_t lda2, auto w2) {
        gemm_silu_t(act, a2, w2, m, f, k2, lda2, ldo);
      }))
    return;
  switch (dt) {
    case DType::F32: return gemm_silu_t(act, a, static_cast<const float*>(w), m, f, k, lda, ldo);
    case DType::BF16: return gemm_silu_t(act, a, static_cast<const bf16*>(w), m, f, k, lda, ldo);
    case DType::F16: return gemm_silu_t(act, a, static_cast<const f16*>(w), m, f, k, lda, ldo);
  }
}

// GGUF blocks, decode (quant.hpp q_decode_gemm's rows): gate panel j and up panel j of MR rows, then
// SiLU-and-mul. Up to 2 rows take both panels in one micro-kernel pass (panels `pairs` apart).
template <int T, int MR>
void q_gated_decode(float* act, const float* a, const uint8_t* w, int64_t pairs, int64_t nb, int64_t lda,
                    int64_t ldo) {
  const int64_t ps = nb * qchunk_bytes(qformat(T), kNR);
  share_tiles(1, pairs, 2, 2 * pairs * kNR * nb * qformat(T).block > 32768, [&](int64_t, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      alignas(64) float buf[MR * 2 * kNR];
      if constexpr (MR <= 2) {  // gate j, then j + 1; up j, then j + 1
        q_micro<T, MR, 2>(a, lda, w + j * ps, pairs * ps, nb, buf, 2 * kNR, kNR, ps);
      } else {  // gate j, up j, gate j + 1
        q_micro<T, MR, 1>(a, lda, w + j * ps, ps, nb, buf, 2 * kNR, kNR, pairs * ps);
        q_micro<T, MR, 1>(a, lda, w + (j + pairs) * ps, ps, nb, buf + kNR, 2 * kNR, kNR, (1 - pairs) * ps);
      }
      for (int i = 0; i < MR; ++i)
        silu_mul_row(act + i * ldo + j * kNR, buf + 2 * i * kNR, buf + (2 * i + 1) * kNR, kNR);
    }
  });
}

// GGUF blocks, batch rows (qgemm_t's second path): each pair's gate and up chunks decoded into the
// L1 buffer in turn, every row tile run over them into the scratch, then SiLU-and-mul.
template <int T>
void q_gated_batch(float* act, const float* a, const uint8_t* w, int64_t m, int64_t pairs, int64_t nb, int64_t lda,
                   int64_t ldo) {
  constexpr QFormat f = qformat(T);
  const int64_t ps = nb * qchunk_bytes(f, kNR);
  const int64_t m_tiles = row_tiles(m, 2 * pairs);
  const int64_t mc = ((m + m_tiles - 1) / m_tiles + kMR - 1) / kMR * kMR;
  const int64_t bpc = std::max<int64_t>(1, kQKC / f.block);
  share_tiles(m_tiles, pairs, 1, true, [&](int64_t mt, int64_t j0, int64_t j1) {  // qgemm_t's, in pairs
    const int64_t m0 = mt * mc, m1 = std::min(m, m0 + mc);
    if (m0 >= m) return;
    alignas(64) float buf[kQKC * kNR];
    static thread_local std::vector<float> scratch;
    scratch.resize(static_cast<size_t>((m1 - m0) * 2 * kNR));
    for (int64_t j = j0; j < j1; ++j) {
      for (int half = 0; half < 2; ++half)
        for (int64_t b0 = 0; b0 < nb; b0 += bpc) {
          const int64_t b1 = std::min(nb, b0 + bpc), kc = (b1 - b0) * f.block;
          q_dequant<T>(w + (j + half * pairs) * ps, b0, b1, buf);
          for (int64_t r = m0; r < m1; r += kMR)
            micro_rows(static_cast<int>(std::min<int64_t>(kMR, m1 - r)), a + r * lda + b0 * f.block, lda,
                       static_cast<const float*>(buf), kc, 0, kc, scratch.data() + (r - m0) * 2 * kNR + half * kNR,
                       2 * kNR, 0, 1, kNR, b0 == 0);
        }
      for (int64_t r = m0; r < m1; ++r) {
        const float* row = scratch.data() + (r - m0) * 2 * kNR;
        silu_mul_row(act + r * ldo + j * kNR, row, row + kNR, kNR);
      }
    }
  });
}

template <int T>
void q_gated_t(float* act, const float* a, const uint8_t* w, int64_t m, int64_t f, int64_t k, int64_t lda,
               int64_t ldo) {
  const int64_t pairs = f / kNR, nb = k / qformat(T).block;
  if (m > kDecodeRows) return q_gated_batch<T>(act, a, w, m, pairs, nb, lda, ldo);
  for (int64_t r = 0; r < m; r += 8) {
    float* o = act + r * ldo;
    const float* ar = a + r * lda;
    switch (std::min<int64_t>(8, m - r)) {
      case 1: q_gated_decode<T, 1>(o, ar, w, pairs, nb, lda, ldo); break;
      case 2: q_gated_decode<T, 2>(o, ar, w, pairs, nb, lda, ldo); break;
      case 3: q_gated_decode<T, 3>(o, ar, w, pairs, nb, lda, ldo); break;
      case 4: q_gated_decode<T, 4>(o, ar, w, pairs, nb, lda, ldo); break;
      case 5: q_gated_decode<T, 5>(o, ar, w, pairs, nb, lda, ldo); break;
      case 6: q_gated_decode<T, 6>(o, ar, w, pairs, nb, lda, ldo); break;
      case 7: q_gated_decode<T, 7>(o, ar, w, pairs, nb, lda, ldo); break;
      default: q_gated_decode<T, 8>(o, ar, w, pairs, nb, lda, ldo); break;
    }
  }
}

// gemm_silu_impl for a weight packed by qpack_impl (GGUF blocks, float activations).
void qgemm_silu_impl(float* act, const float* a, const uint8_t* w, int t, int64_t m, int64_t f, int64_t k,
                     int64_t lda, int64_t ldo) {
  if (f % kNR != 0)
    return silu_after(act, m, f, ldo,
                      [&](float* proj) { qgemm_impl(proj, a, w, t, nullptr, m, 2 * f, k, lda, 2 * f); });
#define CPUSERVE_QGATED(T) q_gated_t<T>(act, a, w, m, f, k, lda, ldo)
  CPUSERVE_QTYPE_SWITCH(t, CPUSERVE_QGATED)
#undef CPUSERVE_QGATED
}

// W8A8 (int8.hpp): gate panel j and up panel j of rows [r, r + mr), then SiLU-and-mul. Up to 2
// rows (decode) take both panels in one micro-kernel pass (panels `pairs` apart); the integer
// sums are exact and the float epilogue is i8gemm's, so the bits are i8gemm's then silu_and_mul's.
inline void i8_gated_tile(const I8Rows& A, const I8Packed& W, int mr, int64_t r, int64_t j, int64_t pairs, float* act,
                          int64_t ldo) {
  alignas(64) int32_t acc[kI8MR * 2 * kI8NR];
  alignas(64) float g[kI8MR * kI8NR], u[kI8MR * kI8NR];
  const int64_t ps = A.kp * kI8NR;
  int32_t *ga = acc, *ua = acc + kI8NR;  // [row][gate | up] when both panels ran in one pass
  int64_t row_stride = 2 * kI8NR;
  if (mr <= 2) {
    i8_sums(A, mr, 2, r, W.q + j * ps, pairs * ps, acc);
  } else {  // [gate rows][up rows]
    i8_sums(A, mr, 1, r, W.q + j * ps, ps, acc);
    i8_sums(A, mr, 1, r, W.q + (j + pairs) * ps, ps, acc + kI8MR * kI8NR);
    ua = acc + kI8MR * kI8NR;
    row_stride = kI8NR;
  }
  const int64_t c0 = j * kI8NR, u0 = (j + pairs) * kI8NR;
  for (int i = 0; i < mr; ++i) {
    i8_out_row(A, r + i, ga + i * row_stride, W.sums, W.scales, nullptr, c0, c0 + kI8NR, g + i * kI8NR);
    i8_out_row(A, r + i, ua + i * row_stride, W.sums, W.scales, nullptr, u0, u0 + kI8NR, u + i * kI8NR);
    silu_mul_row(act + (r + i) * ldo + c0, g + i * kI8NR, u + i * kI8NR, kI8NR);
  }
}

// gemm_silu_impl for a weight packed by i8pack_impl (W8A8, activations quantized per token).
void i8gemm_silu_impl(float* act, const float* a, const uint8_t* w, int64_t m, int64_t f, int64_t k, int64_t lda,
                      int64_t ldo, bool asym) {
  if (f % kI8NR != 0)
    return silu_after(act, m, f, ldo,
                      [&](float* proj) { i8gemm_impl(proj, a, w, nullptr, m, 2 * f, k, lda, 2 * f, asym); });
  const I8Rows A = i8_rows_of(a, m, k, lda, asym);
  const I8Packed W(w, 2 * f, k);
#ifdef __AMX_INT8__
  return amx_i8gemm_silu(act, A, W, m, f, ldo);
#endif
  const int64_t pairs = f / kI8NR;
  if (m <= 2) {  // decode, as i8gemm's
    share_tiles(1, pairs, 2, 2 * f * k > 32768, [&](int64_t, int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) i8_gated_tile(A, W, static_cast<int>(m), 0, j, pairs, act, ldo);
    });
    return;
  }
  i8_schedule<kI8MR>(m, pairs, W.q, A.kp * kI8NR, [&](int mr, int64_t r, int64_t j) {
    i8_gated_tile(A, W, mr, r, j, pairs, act, ldo);
  });
}

// GGUF blocks on int8 dot products (qdot.hpp): gate panel j and up panel j of rows [r, r + mr),
// then SiLU-and-mul. Decode (ahead > 0) streams gate j, up j, gate j + 1.
template <int T>
inline void qd_gated_tile(const QdRows& A, int mr, int64_t r, int64_t j, const uint8_t* w, int64_t ps, int64_t pairs,
                          float* act, int64_t ldo, int64_t ahead) {
  alignas(64) float g[kQdMR * kI8NR], u[kQdMR * kI8NR];
  qd_micro_rows<T>(A, mr, r, w + j * ps, g, ahead, pairs * ps);
  qd_micro_rows<T>(A, mr, r, w + (j + pairs) * ps, u, ahead, (1 - pairs) * ps);
  for (int i = 0; i < mr; ++i) {
    float *gi = g + i * kI8NR, *ui = u + i * kI8NR;
    for (int e = 0; e < kI8NR; ++e) {  // as qd_tile writes C without a bias: + 0 (a -0 becomes +0)
      gi[e] += 0.f;
      ui[e] += 0.f;
    }
    silu_mul_row(act + (r + i) * ldo + j * kI8NR, gi, ui, kI8NR);
  }
}

template <int T>
void qd_gated_t(float* act, const float* a, const uint8_t* w, int64_t m, int64_t f, int64_t k, int64_t lda,
                int64_t ldo) {
  const QdRows A = qd_rows_of(a, m, k, lda, qformat(T).group);
  const int64_t pairs = f / kI8NR, ps = A.ng * qd_chunk_bytes(qformat(T));
  if (m <= kQdMR) {  // decode, as qd_gemm_t's
    share_tiles(1, pairs, 2, 2 * f * k > 32768, [&](int64_t, int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j)
        qd_gated_tile<T>(A, static_cast<int>(m), 0, j, w, ps, pairs, act, ldo, kQdAhead);
    });
    return;
  }
  i8_schedule<kQdMR>(m, pairs, w, ps, [&](int mr, int64_t r, int64_t j) {
    qd_gated_tile<T>(A, mr, r, j, w, ps, pairs, act, ldo, 0);
  });
}

// gemm_silu_impl for a weight packed by qdpack_impl (GGUF blocks on int8 dot products).
void qdgemm_silu_impl(float* act, const float* a, const uint8_t* w, int t, int64_t m, int64_t f, int64_t k,
                      int64_t lda, int64_t ldo) {
  if (!qd_supported(t)) return;
  if (f % kI8NR != 0)
    return silu_after(act, m, f, ldo,
                      [&](float* proj) { qdgemm_impl(proj, a, w, t, nullptr, m, 2 * f, k, lda, 2 * f); });
  switch (static_cast<QType>(t)) {
    case QType::Q4_0: return qd_gated_t<int(QType::Q4_0)>(act, a, w, m, f, k, lda, ldo);
    case QType::Q4_1: return qd_gated_t<int(QType::Q4_1)>(act, a, w, m, f, k, lda, ldo);
    case QType::Q5_0: return qd_gated_t<int(QType::Q5_0)>(act, a, w, m, f, k, lda, ldo);
    case QType::Q5_1: return qd_gated_t<int(QType::Q5_1)>(act, a, w, m, f, k, lda, ldo);
    case QType::Q8_0: return qd_gated_t<int(QType::Q8_0)>(act, a, w, m, f, k, lda, ldo);
    case QType::Q4_K: return qd_gated_t<int(QType::Q4_K)>(act, a, w, m, f, k, lda, ldo);
    case QType::Q5_K: return qd_gated_t<int(QType::Q5_K)>(act, a, w, m, f, k, lda, ldo);
    case QType::Q6_K: return qd_gated_t<int(QType::Q6_K)>(act, a, w, m, f, k, lda, ldo);
    case QType::Q4_ZP: return qd_gated_t<int(QType::Q4_ZP)>(act, a, w, m, f, k, lda, ldo);
  }
}

}  // namespace
}  // namespace cpuserve
