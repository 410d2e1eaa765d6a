// W8A8 GEMM: int8 weights with a float scale per output channel (compressed-tensors'
// "channel" strategy), activations quantized to int8 per token on the fly (dynamic,
// symmetric or with a zero point), int32 dot products, float32 out:
//
//   C[m, n] = float(sum_k qa[m, k] * qw[n, k] - za[m] * sum_k qw[n, k]) * (sa[m] * sw[n]) (+ bias[n])
//
// The integer sums are exact, so every ISA (VNNI's vpdpbusd, AVX2/AVX-512 maddubs, NEON
// sdot or widening multiplies, z14 even/odd multiplies, scalar) gives the same bits; the
// torch reference in model_executor/ops_ref.py computes the same expression.
//
// Packed weight: panels of kI8NR columns [kpad / 4][kI8NR][4] int8 (a column's 4 consecutive
// k together, the operand shape of a 4-way int8 dot), then the columns' int32 weight sums
// and float scales, each padded to whole panels.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#include "../vec/vec.hpp"
#include "line_vector.hpp"
#include "prefetch.hpp"
#include "shares.hpp"

namespace cpuserve {
namespace {

constexpr int kI8NR = 2 * VecI8::L;
// Rows of a batch tile: 12 with AVX-512 VNNI (i8_micro_vnni), 4 elsewhere. vpdpbusd has a latency of
// four cycles at two a cycle (AMD EPYC Zen 5): the 4-row tile (8 chains, the intrinsic) reached
// 3.0-4.0 G of them a second on one core, hot, 12 rows (24 chains, the asm below) 6.8-7.1.
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
constexpr int kI8MR = 12;
#else
constexpr int kI8MR = 4;
#endif

// K of the packed weights and quantized activations: whole 4-way dots, or whole AMX tiles of 64
// on the amx table (amx.hpp), zero padded.
#ifdef __AMX_INT8__
constexpr int64_t kI8KAlign = 64;
#else
constexpr int64_t kI8KAlign = 4;
#endif
inline int64_t i8_kpad(int64_t k) { return (k + kI8KAlign - 1) / kI8KAlign * kI8KAlign; }
inline int64_t i8_panels(int64_t n) { return (n + kI8NR - 1) / kI8NR; }

int64_t i8packed_bytes_impl(int64_t n, int64_t k) {
  return i8_panels(n) * kI8NR * (i8_kpad(k) + sizeof(int32_t) + sizeof(float));
}

void i8pack_impl(uint8_t* dst, const int8_t* w, const float* scale, int64_t n, int64_t k) {
  const int64_t kp = i8_kpad(k), panels = i8_panels(n), q4 = kp / 4;
  int8_t* out = reinterpret_cast<int8_t*>(dst);
  uint8_t* sums = dst + panels * kI8NR * kp;
  uint8_t* scales = sums + panels * kI8NR * sizeof(int32_t);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int j = 0; j < kI8NR; ++j) {
      const int64_t col = p * kI8NR + j;
      int32_t sum = 0;
      for (int64_t q = 0; q < q4; ++q)
        for (int b = 0; b < 4; ++b) {
          const int64_t kk = 4 * q + b;
          const int8_t v = (col < n && kk < k) ? w[col * k + kk] : int8_t(0);
          out[((p * q4 + q) * kI8NR + j) * 4 + b] = v;
          sum += v;
        }
      const float s = col < n ? scale[col] : 0.f;
      std::memcpy(sums + col * sizeof(int32_t), &sum, sizeof(sum));
      std::memcpy(scales + col * sizeof(float), &s, sizeof(s));
    }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// The max (Max) or min of v's 8 lanes.
template <bool Max>
inline float i8_reduce8(__m256 v) {
  auto op = [](__m128 a, __m128 b) { return Max ? _mm_max_ps(a, b) : _mm_min_ps(a, b); };
  __m128 x = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = op(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(op(x, _mm_shuffle_ps(x, x, 1)));
}
#endif

// The least and greatest of x[0, k) (k > 0), folded from x[0] as std::min / std::max fold them: a
// NaN after x[0] is passed over (so does vminps / vmaxps, which return their second operand on one).
inline void i8_min_max(const float* x, int64_t k, float& lo, float& hi) {
  lo = hi = x[0];
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 vlo = _mm512_set1_ps(lo), vhi = vlo;
  for (; i + 16 <= k; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    vlo = _mm512_min_ps(v, vlo);
    vhi = _mm512_max_ps(v, vhi);
  }
  lo = _mm512_reduce_min_ps(vlo), hi = _mm512_reduce_max_ps(vhi);
#elif defined(__AVX2__)
  __m256 vlo = _mm256_set1_ps(lo), vhi = vlo;
  for (; i + 8 <= k; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vlo = _mm256_min_ps(v, vlo);
    vhi = _mm256_max_ps(v, vhi);
  }
  lo = i8_reduce8<false>(vlo), hi = i8_reduce8<true>(vhi);
#endif
  for (; i < k; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
}

// The greatest |x[i]| of x[0, k), from 0 (NaN passed over, as in i8_min_max).
inline float i8_abs_max(const float* x, int64_t k) {
  float amax = 0.f;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 va = _mm512_setzero_ps();
  for (; i + 16 <= k; i += 16) va = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), va);
  amax = _mm512_reduce_max_ps(va);
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 va = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) va = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), va);
  amax = i8_reduce8<true>(va);
#endif
  for (; i < k; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

// q[i] = clamp(rne(x[i] / s) + z, -127, 127) for i < k (a NaN: -127, as std::max(-127.f, NaN) gives).
// The vector paths divide, round and clamp as the scalar one does: the same codes.
inline void i8_codes(const float* x, int64_t k, float s, int32_t z, int8_t* q) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(static_cast<float>(z));
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (; i + 16 <= k; i += 16) {
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vs),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 v = _mm512_min_ps(hi, _mm512_max_ps(_mm512_add_ps(r, vz), lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
  }
#elif defined(__AVX2__)
  const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(static_cast<float>(z));
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (; i + 8 <= k; i += 8) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vs),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i v = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(_mm256_add_ps(r, vz), lo)));
    const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(h, h));
  }
#endif
  for (; i < k; ++i) {
    const float v = std::nearbyint(x[i] / s) + static_cast<float>(z);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
  }
}

// One row of activations -> int8 codes in [-127, 127] (padded with zeros to kpad), scale, zero.
//   symmetric:  s = max|x| / 127, q = rne(x / s), z = 0
//   asymmetric: s = (max x - min x) / 254, z = rne(-127 - min x / s), q = clamp(rne(x / s) + z)
// A constant row that would give s = 0 uses s = 1. On AVX-512 and AVX2 in vectors (the same codes):
// the scalar loops, a division each, took as long as the GEMM's dot products on a batch (AMD EPYC
// Zen 5, 2,048 x 1,536 x 576).
inline void i8_quant_row(const float* x, int64_t k, int64_t kp, int8_t* q, float& s, int32_t& z, bool asym) {
  float lo = 0.f, hi = 0.f;
  if (asym) {
    if (k > 0) i8_min_max(x, k, lo, hi);
    s = (hi - lo) / 254.f;
  } else {
    s = i8_abs_max(x, k) / 127.f;
  }
  if (!(s > 0.f)) s = 1.f;
  z = asym ? static_cast<int32_t>(std::nearbyint(-127.f - lo / s)) : 0;
  i8_codes(x, k, s, z, q);
  for (int64_t i = k; i < kp; ++i) q[i] = 0;
}

inline int32_t rd_i32(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

// MR rows x NP panels: int32 sums over all of k into acc[r][p * kI8NR + j].
template <int MR, int NP>
inline void i8_micro(const int8_t* qa, int64_t kp, const int8_t* w, int64_t panel_stride, int32_t* acc_out) {
  VecI8 acc[MR][NP][2];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p][0] = acc[r][p][1] = VecI8::zero();
  for (int64_t q = 0; q < kp / 4; ++q) {
    const int8_t* b = w + q * kI8NR * 4;
    for (int r = 0; r < MR; ++r) {
      const typename VecI8::A a = VecI8::bcast(rd_i32(qa + r * kp + 4 * q));
      for (int p = 0; p < NP; ++p) {
        acc[r][p][0] = VecI8::dot(acc[r][p][0], a, b + p * panel_stride);
        acc[r][p][1] = VecI8::dot(acc[r][p][1], a, b + p * panel_stride + 4 * VecI8::L);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) {
      acc[r][p][0].store(acc_out + (r * NP + p) * kI8NR);
      acc[r][p][1].store(acc_out + (r * NP + p) * kI8NR + VecI8::L);
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
// acc += a's unsigned bytes x w's signed bytes, four to a lane (vpdpbusd). Written in asm: in an
// unrolled tile GCC 12 compiled the intrinsic to a copy of the accumulator into another register
// and back and a store of it to the stack, at every step (the batch GEMMs took 1.4-1.8x the time).
[[gnu::always_inline]] inline void dpbusd(__m512i& acc, __m512i a, __m512i w) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(w));
}

// i8_micro<MR, 1> on VNNI: MR rows x one panel, int32 sums over all of k into acc_out[r * kI8NR + j].
template <int MR>
[[gnu::noinline]] void i8_micro_vnni(const int8_t* qa, int64_t kp, const int8_t* w, int32_t* acc_out) {
  __m512i c0[MR], c1[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) c0[r] = c1[r] = _mm512_setzero_si512();
  const __m512i to_unsigned = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));  // codes + 128
  for (int64_t q = 0; q < kp / 4; ++q) {
    const __m512i w0 = _mm512_loadu_si512(w + q * 4 * kI8NR), w1 = _mm512_loadu_si512(w + q * 4 * kI8NR + 64);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512i a = _mm512_xor_si512(_mm512_set1_epi32(rd_i32(qa + r * kp + 4 * q)), to_unsigned);
      dpbusd(c0[r], a, w0);
      dpbusd(c1[r], a, w1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_si512(acc_out + r * kI8NR, c0[r]);
    _mm512_storeu_si512(acc_out + r * kI8NR + VecI8::L, c1[r]);
  }
}
#endif

// MR x 1 panel sums for a run-time mr <= R (i8_micro_vnni with VNNI: the same exact sums).
template <int R>
inline void i8_micro_rows(int mr, const int8_t* qa, int64_t kp, const int8_t* w, int64_t panel_stride,
                          int32_t* acc) {
  if constexpr (R > 1)
    if (mr < R) return i8_micro_rows<R - 1>(mr, qa, kp, w, panel_stride, acc);
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  i8_micro_vnni<R>(qa, kp, w, acc);
#else
  i8_micro<R, 1>(qa, kp, w, panel_stride, acc);
#endif
}

struct I8Rows {  // quantized activations
  const int8_t* q;
  const float* s;
  const int32_t* z;
  int64_t kp;
};

// The integer sums of rows [r, r + mr) x panels [p, p + np), panels `panel_stride` int8 apart,
// into acc[i][np * kI8NR] (np: 1, 2 (one or two rows) or 4 (one row)).
inline void i8_sums(const I8Rows& A, int mr, int np, int64_t r, const int8_t* wp, int64_t panel_stride,
                    int32_t* acc) {
  const int8_t* qa = A.q + r * A.kp;
  if (np == 4) return i8_micro<1, 4>(qa, A.kp, wp, panel_stride, acc);
  if (np == 2) return mr == 1 ? i8_micro<1, 2>(qa, A.kp, wp, panel_stride, acc)
                              : i8_micro<2, 2>(qa, A.kp, wp, panel_stride, acc);
  i8_micro_rows<kI8MR>(mr, qa, A.kp, wp, panel_stride, acc);
}

// Row `row`'s outputs of columns [c0, c1) from its integer sums acc[col - c0] to float, into out[col - c0].
// `offset`: what the sums' activation codes were shifted by (VecI8's unsigned dots: 128; AMX: 0).
inline void i8_out_row(const I8Rows& A, int64_t row, const int32_t* acc, const int32_t* sums, const float* scales,
                       const float* bias, int64_t c0, int64_t c1, float* out, int32_t offset = VecI8::kOffset) {
  const int32_t comp = offset + A.z[row];
  const float sa = A.s[row];
  for (int64_t col = c0; col < c1; ++col) {
    const int32_t v = acc[col - c0] - comp * sums[col];
    float o = static_cast<float>(v) * (sa * scales[col]);
    if (bias != nullptr) o += bias[col];
    out[col - c0] = o;
  }
}

// Whether a batch tile asks for its lines of C before its dot products (as gemm.hpp's tiles do, see
// kFetchTileOfC there): AVX-512.
#ifdef __AVX512F__
constexpr bool kI8FetchTileOfC = true;
#else
constexpr bool kI8FetchTileOfC = false;
#endif

// Rows [r, r + mr) x panels [p, p + np) of C, from the integer sums to float.
inline void i8_tile(const I8Rows& A, int mr, int np, int64_t r, int64_t p, const int8_t* w, const int32_t* sums,
                    const float* scales, const float* bias, float* c, int64_t n, int64_t ldc) {
  alignas(64) int32_t acc[std::max(kI8MR, 4) * kI8NR];  // (mr x np <= max(kI8MR, 4))
  const int64_t ps = A.kp * kI8NR;
  if (np == 1 && kI8FetchTileOfC)
    for (int i = 0; i < mr; ++i) fetch_for_write(c + (r + i) * ldc + p * kI8NR, kI8NR);
  i8_sums(A, mr, np, r, w + p * ps, ps, acc);
  const int64_t c0 = p * kI8NR, c1 = std::min(n, (p + np) * kI8NR);
  for (int i = 0; i < mr; ++i)
    i8_out_row(A, r + i, acc + i * np * kI8NR, sums, scales, bias, c0, c1, c + (r + i) * ldc + c0);
}

// The int8 GEMMs' batch schedule. Work items: a block of up to 256 rows (its codes stay in L2)
// x a panel (it stays in L1/L2 while every row tile of the block runs over it), handed out in
// self-balancing shares (shares.hpp); tile(mr, r, p) computes rows [r, r + mr) x panel p. Each
// panel is `panel_bytes` from `w`; the next one is prefetched a slice before each row tile
// (kernels/prefetch.hpp).
template <int MR, typename Tile>
inline void i8_schedule(int64_t m, int64_t panels, const void* w, int64_t panel_bytes, const Tile& tile) {
  constexpr int64_t kMC8 = 256;
  const int64_t m_blocks = (m + kMC8 - 1) / kMC8;
  share_tiles(m_blocks, panels, 1, true, [&](int64_t mb, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r0 = mb * kMC8, r1 = std::min(m, r0 + kMC8), tiles = (r1 - r0 + MR - 1) / MR;
      const Prefetch next = Prefetch::bytes(static_cast<const char*>(w) + (p + 1) % panels * panel_bytes,
                                            tiles > 1 ? panel_bytes : 0);
      for (int64_t r = r0, t = 0; r < r1; r += MR, ++t) {
        next.slice(t, tiles).issue();
        tile(static_cast<int>(std::min<int64_t>(MR, m - r)), r, p);
      }
    }
  });
}

// The rows of A quantized per token into the calling thread's buffers (valid until its next call).
inline I8Rows i8_rows_of(const float* a, int64_t m, int64_t k, int64_t lda, bool asym) {
  const int64_t kp = i8_kpad(k);
  thread_local LineVector<int8_t> qbuf;
  thread_local std::vector<float> sbuf;
  thread_local std::vector<int32_t> zbuf;
  qbuf.resize(static_cast<size_t>(m * kp));
  sbuf.resize(static_cast<size_t>(m));
  zbuf.resize(static_cast<size_t>(m));
  int8_t* q = qbuf.data();
  float* s = sbuf.data();
  int32_t* z = zbuf.data();
#pragma omp parallel for schedule(static) if (m > 8)
  for (int64_t r = 0; r < m; ++r) i8_quant_row(a + r * lda, k, kp, q + r * kp, s[r], z[r], asym);
  return I8Rows{q, s, z, kp};
}

// A packed weight's parts (i8pack_impl's layout).
struct I8Packed {
  const int8_t* q;
  const int32_t* sums;
  const float* scales;
  I8Packed(const uint8_t* w, int64_t n, int64_t k)
      : q(reinterpret_cast<const int8_t*>(w)),
        sums(reinterpret_cast<const int32_t*>(w + i8_panels(n) * kI8NR * i8_kpad(k))),
        scales(reinterpret_cast<const float*>(w + i8_panels(n) * kI8NR * (i8_kpad(k) + sizeof(int32_t)))) {}
};

#ifdef __AMX_INT8__
// amx.hpp: every W8A8 GEMM of the amx table
void amx_i8gemm(float* c, const I8Rows& A, const I8Packed& W, const float* bias, int64_t m, int64_t n, int64_t ldc);
#endif

void i8gemm_impl(float* c, const float* a, const uint8_t* w, const float* bias, int64_t m, int64_t n, int64_t k,
                 int64_t lda, int64_t ldc, bool asym) {
  const int64_t kp = i8_kpad(k), panels = i8_panels(n);
  const I8Rows A = i8_rows_of(a, m, k, lda, asym);
  const I8Packed W(w, n, k);
#ifdef __AMX_INT8__
  return amx_i8gemm(c, A, W, bias, m, n, ldc);
#endif
  const int8_t* wq = W.q;
  const int32_t* sums = W.sums;
  const float* scales = W.scales;
  if (m <= 2) {  // decode: 4 panels at once for enough independent loads in flight
    const int64_t groups = (panels + 3) / 4;
    share_tiles(1, groups, 1, n * k > 32768, [&](int64_t, int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t r = 0; r < m; ++r) {
          const int64_t p = 4 * g;
          if (p + 4 <= panels) i8_tile(A, 1, 4, r, p, wq, sums, scales, bias, c, n, ldc);
          else
            for (int64_t pp = p; pp < panels; ++pp) i8_tile(A, 1, 1, r, pp, wq, sums, scales, bias, c, n, ldc);
        }
    });
    return;
  }
  i8_schedule<kI8MR>(m, panels, wq, kp * kI8NR, [&](int mr, int64_t r, int64_t p) {
    i8_tile(A, mr, 1, r, p, wq, sums, scales, bias, c, n, ldc);
  });
}

}  // namespace
}  // namespace cpuserve
