// GEMM on GGUF block-quantized weights kept in their blocks (layout in
// quant_format.hpp): C[M, N] = A[M, K] @ W^T (+ bias), A and C float32.
//
// Weights are decoded into float32 registers, never into a float32 copy of W:
//   M <= 32 (decode; 8 with 16 vector registers) each panel row is decoded and
//                    used at once by up to 8 rows of A (a pass per 8 rows), 2 panels
//                    wide at M <= 2 (the accumulators of more rows fill the
//                    registers), else one panel at a time;
//   larger M         a 256-row chunk of one panel is decoded into an L1 buffer
//                    and every row tile of A runs the dense micro-kernel on it,
//                    so a step of 64 sequences decodes each block once.
// Each weight decodes to exactly the reference dequantization, and each C
// element is the same single fused multiply-add chain over k as the dense
// GEMM's: the result equals gemm() on the dequantized weight, bit for bit,
// whatever M, the path or the thread count (batch invariance holds).
#pragma once
#include <cmath>
#include <cstring>
#include <type_traits>
#include "gemm.hpp"
#include "quant_format.hpp"

#ifndef CPUSERVE_QPF
#define CPUSERVE_QPF 3072
#endif
namespace cpuserve {
namespace {

// Up to this many rows of A take the decode path, 8 rows a pass (each pass decodes the weights
// again). Measured (Q4_1, the default model's 121 GEMMs, AMD Zen 5): with 32 vector registers
// 2 passes at 16 rows 11.4 ms against 14.6 through the L1 buffer, 4 at 32 rows 22.0 against
// 24.4, even at 48; with AVX2's 16 (8-row accumulators spill) 8 rows 14.4 against 16.2 but 16
// rows 28.2 against 23.5.
constexpr int64_t kDecodeRows = VecF::kRegs >= 32 ? 32 : 8;
constexpr int64_t kQKC = 256;                 // rows of a panel decoded at once past kDecodeRows (32 KB at NR = 32)
constexpr int64_t kQPrefetch = CPUSERVE_QPF;  // bytes ahead of each panel's stream the decode path fetches

inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t rd32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

// One GGUF block, unpacked: unsigned codes and the header fields.
struct QBlock {
  uint16_t d = 0, m = 0;  // f16 bits: scale, and min / dmin
  uint8_t sc[16] = {}, mn[8] = {};
  uint8_t u[256] = {};
};

inline void nibbles32(const uint8_t* qs, uint8_t* u) {
  for (int i = 0; i < 16; ++i) { u[i] = qs[i] & 15; u[i + 16] = qs[i] >> 4; }
}

inline void k_scale_min(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// The element order is gguf-py's dequantize_blocks' (and ggml's).
inline void unpack_gguf(int t, const uint8_t* b, QBlock& o) {
  switch (static_cast<QType>(t)) {
    case QType::Q4_0: o.d = rd16(b); nibbles32(b + 2, o.u); break;
    case QType::Q4_1: o.d = rd16(b); o.m = rd16(b + 2); nibbles32(b + 4, o.u); break;
    case QType::Q4_ZP: o.d = rd16(b); o.sc[0] = b[2]; nibbles32(b + 4, o.u); break;
    case QType::Q5_0:
    case QType::Q5_1: {
      const int h = t == int(QType::Q5_1) ? 2 : 0;
      o.d = rd16(b);
      if (h) o.m = rd16(b + 2);
      const uint32_t qh = rd32(b + 2 + h);
      nibbles32(b + 6 + h, o.u);
      for (int i = 0; i < 32; ++i) o.u[i] |= ((qh >> i) & 1u) << 4;
      break;
    }
    case QType::Q8_0:
      o.d = rd16(b);
      for (int i = 0; i < 32; ++i) o.u[i] = static_cast<uint8_t>(static_cast<int8_t>(b[2 + i]) + 128);
      break;
    case QType::Q4_K:
    case QType::Q5_K: {
      const bool five = t == int(QType::Q5_K);
      o.d = rd16(b);
      o.m = rd16(b + 2);
      k_scale_min(b + 4, o.sc, o.mn);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int s = 0; s < 8; ++s)
        for (int i = 0; i < 32; ++i) {
          uint8_t q = (qs[32 * (s / 2) + i] >> (4 * (s % 2))) & 15;
          if (five) q |= ((qh[i] >> s) & 1) << 4;
          o.u[32 * s + i] = q;
        }
      break;
    }
    case QType::Q6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, r = e % 128;
        const int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 15;
        const int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
        o.u[e] = static_cast<uint8_t>(lo | (hi << 4));
      }
      for (int j = 0; j < 16; ++j) o.sc[j] = static_cast<uint8_t>(static_cast<int8_t>(b[192 + j]) + 128);
      o.d = rd16(b + 208);
      break;
    }
  }
}

// Writes column j of one (panel, block) chunk (zeroed beforehand).
inline void put_column(const QFormat& f, int t, const QBlock& q, uint8_t* chunk, int j) {
  const int nr = kNR;
  std::memcpy(chunk + 2 * j, &q.d, 2);
  if (f.header >= 4 && t != int(QType::Q6_K)) std::memcpy(chunk + 2 * nr + 2 * j, &q.m, 2);
  if (t == int(QType::Q4_ZP)) chunk[2 * nr + j] = q.sc[0];
  if (f.header == 20)
    for (int g = 0; g < 8; ++g) {
      chunk[4 * nr + g * nr + j] = q.sc[g];
      chunk[12 * nr + g * nr + j] = q.mn[g];
    }
  if (t == int(QType::Q6_K))
    for (int g = 0; g < 16; ++g) chunk[2 * nr + g * nr + j] = q.sc[g];
  uint8_t* codes = chunk + f.header * nr;
  for (int r = 0; r < f.block; ++r) {
    const uint8_t u = q.u[r];
    if (f.bits == 8) { codes[r * nr + j] = u; continue; }
    codes[(r >> 1) * nr + j] |= static_cast<uint8_t>((u & 15) << (4 * (r & 1)));
    uint8_t* hi = codes + (f.block / 2) * nr;
    if (f.bits == 5) hi[(r >> 3) * nr + j] |= static_cast<uint8_t>(((u >> 4) & 1) << (r & 7));
    if (f.bits == 6) hi[(r >> 2) * nr + j] |= static_cast<uint8_t>(((u >> 4) & 3) << (2 * (r & 3)));
  }
}

// dst: qpacked_bytes(t, n, k, kNR) bytes; src: n rows of k / B GGUF blocks, fields in host byte order.
void qpack_impl(uint8_t* dst, const uint8_t* src, int t, int64_t n, int64_t k) {
  const QFormat f = qformat(t);
  const int64_t nb = k / f.block, cb = qchunk_bytes(f, kNR), panels = (n + kNR - 1) / kNR;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    QBlock q;
    std::memset(dst + p * nb * cb, 0, nb * cb);
    for (int64_t b = 0; b < nb; ++b)
      for (int j = 0; j < kNR && p * kNR + j < n; ++j) {
        unpack_gguf(t, src + ((p * kNR + j) * nb + b) * f.gguf_bytes, q);
        put_column(f, t, q, dst + (p * nb + b) * cb, j);
      }
  }
}

// Scale and offset of group g for the columns [col0, col0 + N) of a chunk.
template <int T>
inline void group_so(const uint8_t* chunk, int g, int col0, VecF& s, VecF& o) {
  constexpr QFormat f = qformat(T);
  const VecF d = VecF::load(reinterpret_cast<const f16*>(chunk) + col0);
  if constexpr (f.header == 20) {  // Q4_K, Q5_K: d * sc, -(dmin * m)
    s = d * VecF::u8(chunk + (4 + g) * kNR + col0, 0, 255);
    o = VecF::zero() - VecF::load(reinterpret_cast<const f16*>(chunk + 2 * kNR) + col0) *
                           VecF::u8(chunk + (12 + g) * kNR + col0, 0, 255);
  } else if constexpr (T == int(QType::Q6_K)) {
    s = d * (VecF::u8(chunk + (2 + g) * kNR + col0, 0, 255) - VecF::set1(128.f));
    o = s * VecF::set1(-32.f);
  } else if constexpr (f.offset_code == 0) {  // Q4_1, Q5_1: d, m
    s = d;
    o = VecF::load(reinterpret_cast<const f16*>(chunk + 2 * kNR) + col0);
  } else if constexpr (f.offset_code < 0) {  // Q4_ZP: d, -(d * z)
    s = d;
    o = VecF::zero() - d * VecF::u8(chunk + 2 * kNR + col0, 0, 255);
  } else {
    s = d;
    o = d * VecF::set1(-static_cast<float>(f.offset_code));
  }
}

// Whether the ISA's VecF decodes 4-bit codes with their high bits in one step (nibbles_hi).
template <typename V, typename = void> struct HasNibblesHi : std::false_type {};
template <typename V> struct HasNibblesHi<V, std::void_t<decltype(&V::nibbles_hi)>> : std::true_type {};
template <typename V, int> struct DependentOn { using type = V; };  // (a name looked up at instantiation)

// The unsigned codes of rows r and r + 1 (r even) of a chunk, columns [col0, col0 + N), as floats.
template <int T>
inline void codes_pair(const uint8_t* codes, int r, int col0, VecF& q0, VecF& q1) {
  constexpr QFormat f = qformat(T);
  if constexpr (f.bits == 8) {
    q0 = VecF::u8(codes + r * kNR + col0, 0, 255);
    q1 = VecF::u8(codes + (r + 1) * kNR + col0, 0, 255);
  } else if constexpr ((f.bits == 5 || f.bits == 6) && HasNibblesHi<VecF>::value) {
    using V = typename DependentOn<VecF, T>::type;
    const uint8_t* hi = codes + (f.block / 2) * kNR + col0;
    if constexpr (f.bits == 5)
      V::nibbles_hi(codes + (r >> 1) * kNR + col0, hi + (r >> 3) * kNR, r & 7, (r & 7) + 1, 1, q0, q1);
    else
      V::nibbles_hi(codes + (r >> 1) * kNR + col0, hi + (r >> 2) * kNR, 2 * (r & 3), 2 * (r & 3) + 2, 3, q0, q1);
  } else {
    VecF::nibbles(codes + (r >> 1) * kNR + col0, q0, q1);
    const uint8_t* hi = codes + (f.block / 2) * kNR + col0;
    if constexpr (f.bits == 5) {
      q0 = VecF::fma(VecF::set1(16.f), VecF::u8(hi + (r >> 3) * kNR, r & 7, 1), q0);
      q1 = VecF::fma(VecF::set1(16.f), VecF::u8(hi + (r >> 3) * kNR, (r & 7) + 1, 1), q1);
    }
    if constexpr (f.bits == 6) {
      q0 = VecF::fma(VecF::set1(16.f), VecF::u8(hi + (r >> 2) * kNR, 2 * (r & 3), 3), q0);
      q1 = VecF::fma(VecF::set1(16.f), VecF::u8(hi + (r >> 2) * kNR, 2 * (r & 3) + 2, 3), q1);
    }
  }
}

// Decode micro-kernel: MR rows of A against NP whole panels over all of K (panels ps bytes
// apart), accumulators in registers from zero (the dense kernel's chain). `then`: where, from
// each panel, the panel the calling thread streams after it starts (bytes): the prefetch runs on
// into it past the panel's end, so that its stream does not start cold.
template <int T, int MR, int NP>
inline void q_micro(const float* a, int64_t lda, const uint8_t* w_, int64_t ps, int64_t nb, float* c,
                    int64_t ldc, int cols, int64_t then) {
  constexpr QFormat f = qformat(T);
  constexpr int64_t cb = qchunk_bytes(f, kNR);
  VecF acc[MR][NP][2];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < NP; ++q) acc[i][q][0] = acc[i][q][1] = VecF::zero();
  constexpr int kGroups = f.block / f.group;
  // With 16 vector registers (AVX2) one row's 4 accumulators, the 2 panels' scales and offsets (8)
  // and the decoded weights do not all fit: GCC 12 kept the scales and offsets in registers and the
  // accumulators on the stack, so that every FMA of a chain waited on a store-to-load round trip.
  // Here the scales and offsets are written to memory once a group and reloaded at each use, as
  // read-only operands, and the accumulators stay in registers. With more rows the accumulators
  // outnumber them and the compiler's own choice was as fast (Zen 3, single thread, 885k weights
  // from L2: Q4_1 77 -> 62 us, Q8_0 78 -> 60, Q4_K 77 -> 66, Q5_K / Q6_K unchanged).
  constexpr bool kSpillSO = VecF::kRegs < 32 && MR == 1;
  alignas(64) float sm[NP][2][VecF::N], om[NP][2][VecF::N];
  for (int64_t b = 0; b < nb; ++b) {
    for (int g = 0; g < kGroups; ++g) {
      // Decoding is slow per byte, so the hardware prefetchers run too close behind: fetch each
      // panel's stream kQPrefetch bytes ahead (its own bytes only), a group's share of the block's
      // lines at a time: a K-quant's block (256 rows, 4.6 KB a panel) fetched at once was a burst
      // of 144 lines for two panels, and from memory Q4_K ran 1.5x slower than Q4_1 (cached 1.1x).
      // Into L2, as prefetch.hpp says why: batch-1 GEMMs of a step (Zen 4, medians of 4 runs taking
      // turns) Q4_1 5.9 -> 5.2 ms, Q4_K_M 8.4 -> 7.4, Q8_0 7.5 -> 5.8 against prefetches into L1.
      const int64_t lo = b * cb + g * cb / kGroups + kQPrefetch, hi = b * cb + (g + 1) * cb / kGroups + kQPrefetch;
      for (int q = 0; q < NP; ++q)
        for (int64_t at = (lo + 63) / 64 * 64; at < hi; at += 64)
          prefetch_l2(w_ + q * ps + (at < nb * cb ? at : then + at - nb * cb));
      VecF s[NP][2], o[NP][2];
      for (int q = 0; q < NP; ++q) {
        group_so<T>(w_ + q * ps + b * cb, g, 0, s[q][0], o[q][0]);
        group_so<T>(w_ + q * ps + b * cb, g, VecF::N, s[q][1], o[q][1]);
      }
      if constexpr (kSpillSO)
        for (int q = 0; q < NP; ++q)
          for (int h = 0; h < 2; ++h) { s[q][h].store(sm[q][h]); o[q][h].store(om[q][h]); }
      const float* ak = a + b * f.block + g * f.group;
      for (int r = 0; r < f.group; r += 2) {
        const int rr = g * f.group + r;
        if constexpr (kSpillSO) {
          asm volatile("" : : "r"(sm), "r"(om) : "memory");  // their loads below are not hoisted out of r
          for (int q = 0; q < NP; ++q)
            for (int h = 0; h < 2; ++h) { s[q][h] = VecF::load(sm[q][h]); o[q][h] = VecF::load(om[q][h]); }
        }
        VecF w[2][NP][2];  // [row of the pair][panel][half]
        for (int q = 0; q < NP; ++q) {
          const uint8_t* codes = w_ + q * ps + b * cb + f.header * kNR;
          for (int h = 0; h < 2; ++h) {
            VecF q0, q1;
            codes_pair<T>(codes, rr, h * VecF::N, q0, q1);
            w[0][q][h] = VecF::fma(s[q][h], q0, o[q][h]);
            w[1][q][h] = VecF::fma(s[q][h], q1, o[q][h]);
          }
        }
        for (int e = 0; e < 2; ++e)
          for (int i = 0; i < MR; ++i) {
            const VecF av = VecF::set1(ak[i * lda + r + e]);
            for (int q = 0; q < NP; ++q) {
              acc[i][q][0] = VecF::fma(av, w[e][q][0], acc[i][q][0]);
              acc[i][q][1] = VecF::fma(av, w[e][q][1], acc[i][q][1]);
            }
          }
      }
    }
  }
  // Whole panels stored straight from the registers: a copy through memcpy from a stored copy
  // (every width) let GCC 12 keep the AVX2 accumulators in memory for the whole k loop.
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < NP; ++q) {
      float* ci = c + i * ldc + q * kNR;
      if (NP > 1 || cols == kNR) {
        acc[i][q][0].store(ci);
        acc[i][q][1].store(ci + VecF::N);
      } else {
        alignas(64) float tmp[kNR];
        acc[i][q][0].store(tmp);
        acc[i][q][1].store(tmp + VecF::N);
        for (int j = 0; j < cols; ++j) ci[j] = tmp[j];
      }
    }
}

// Blocks [b0, b1) of one panel, decoded into buf [(b1 - b0) * B][kNR].
template <int T>
inline void q_dequant(const uint8_t* panel, int64_t b0, int64_t b1, float* buf) {
  constexpr QFormat f = qformat(T);
  constexpr int64_t cb = qchunk_bytes(f, kNR);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* chunk = panel + b * cb;
    for (int g = 0; g < f.block / f.group; ++g) {
      VecF s0, o0, s1, o1;
      group_so<T>(chunk, g, 0, s0, o0);
      group_so<T>(chunk, g, VecF::N, s1, o1);
      for (int r = g * f.group; r < (g + 1) * f.group; r += 2) {
        float* row = buf + ((b - b0) * f.block + r) * kNR;
        VecF q0, q1;
        codes_pair<T>(chunk + f.header * kNR, r, 0, q0, q1);
        VecF::fma(s0, q0, o0).store(row);
        VecF::fma(s0, q1, o0).store(row + kNR);
        codes_pair<T>(chunk + f.header * kNR, r, VecF::N, q0, q1);
        VecF::fma(s1, q0, o1).store(row + VecF::N);
        VecF::fma(s1, q1, o1).store(row + kNR + VecF::N);
      }
    }
  }
}

template <int T, int MR>
void q_decode_gemm(float* c, const float* a, const uint8_t* w, const float* bias, int64_t n, int64_t nb,
                   int64_t lda, int64_t ldc) {
  const int64_t ps = nb * qchunk_bytes(qformat(T), kNR), panels = (n + kNR - 1) / kNR;
  const int64_t pairs = (panels + 1) / 2;
  // pairs of panels in self-balancing shares, 2 pairs at a time (gemm_t's 4-panel decode chunks)
  share_tiles(1, pairs, 2, n * nb * qformat(T).block > 32768, [&](int64_t, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = 2 * g;
      // two panels at once where their accumulators fit the registers (up to 2 rows), else one at a time
      const bool two = MR <= 2 && (p + 2) * kNR <= n;
      if constexpr (MR <= 2)
        if (two) q_micro<T, MR, 2>(a, lda, w + p * ps, ps, nb, c + p * kNR, ldc, kNR, 2 * ps);
      if (!two)
        for (int64_t q = p; q < std::min(panels, p + 2); ++q)
          q_micro<T, MR, 1>(a, lda, w + q * ps, ps, nb, c + q * kNR, ldc,
                            static_cast<int>(std::min<int64_t>(kNR, n - q * kNR)), ps);
      if (bias != nullptr)
        for (int64_t r = 0; r < MR; ++r)
          for (int64_t col = p * kNR; col < std::min(n, (p + 2) * kNR); ++col) c[r * ldc + col] += bias[col];
    }
  });
}

template <int T>
void qgemm_t(float* c, const float* a, const uint8_t* w, const float* bias, int64_t m, int64_t n, int64_t k,
             int64_t lda, int64_t ldc) {
  constexpr QFormat f = qformat(T);
  const int64_t nb = k / f.block, ps = nb * qchunk_bytes(f, kNR), panels = (n + kNR - 1) / kNR;
  if (m <= kDecodeRows) {
    for (int64_t r = 0; r < m; r += 8) {
      float* cr = c + r * ldc;
      const float* ar = a + r * lda;
      switch (std::min<int64_t>(8, m - r)) {
        case 1: q_decode_gemm<T, 1>(cr, ar, w, bias, n, nb, lda, ldc); break;
        case 2: q_decode_gemm<T, 2>(cr, ar, w, bias, n, nb, lda, ldc); break;
        case 3: q_decode_gemm<T, 3>(cr, ar, w, bias, n, nb, lda, ldc); break;
        case 4: q_decode_gemm<T, 4>(cr, ar, w, bias, n, nb, lda, ldc); break;
        case 5: q_decode_gemm<T, 5>(cr, ar, w, bias, n, nb, lda, ldc); break;
        case 6: q_decode_gemm<T, 6>(cr, ar, w, bias, n, nb, lda, ldc); break;
        case 7: q_decode_gemm<T, 7>(cr, ar, w, bias, n, nb, lda, ldc); break;
        default: q_decode_gemm<T, 8>(cr, ar, w, bias, n, nb, lda, ldc); break;
      }
    }
    return;
  }
  const int64_t m_tiles = row_tiles(m, panels);
  const int64_t mc = ((m + m_tiles - 1) / m_tiles + kMR - 1) / kMR * kMR;
  const int64_t bpc = std::max<int64_t>(1, kQKC / f.block);
  // one panel at a time (every row tile of the block runs over its chunks while they sit in L1)
  share_tiles(m_tiles, panels, 1, m * n * k > 32768, [&](int64_t mt, int64_t p0, int64_t p1) {
    const int64_t m0 = mt * mc, m1 = std::min(m, m0 + mc);
    if (m0 >= m) return;
    alignas(64) float buf[kQKC * kNR];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min<int64_t>(kNR, n - p * kNR);
      for (int64_t b0 = 0; b0 < nb; b0 += bpc) {
        const int64_t b1 = std::min(nb, b0 + bpc), kc = (b1 - b0) * f.block;
        q_dequant<T>(w + p * ps, b0, b1, buf);
        for (int64_t r = m0; r < m1; r += kMR)
          micro_rows(static_cast<int>(std::min<int64_t>(kMR, m1 - r)), a + r * lda + b0 * f.block, lda,
                     static_cast<const float*>(buf), kc, 0, kc, c + r * ldc + p * kNR, ldc, 0, 1, cols, b0 == 0);
      }
    }
    if (bias != nullptr)
      for (int64_t r = m0; r < m1; ++r)
        for (int64_t col = p0 * kNR; col < std::min(n, p1 * kNR); ++col) c[r * ldc + col] += bias[col];
  });
}

// Row `id` of a packed weight (column id of W^T), dequantized: scalar, the same arithmetic.
template <int T>
void q_row(float* out, const uint8_t* w, int64_t id, int64_t k) {
  constexpr QFormat f = qformat(T);
  constexpr int64_t cb = qchunk_bytes(f, kNR);
  const int64_t nb = k / f.block, j = id % kNR;
  const uint8_t* panel = w + (id / kNR) * nb * cb;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* ch = panel + b * cb;
    const float d = to_float(reinterpret_cast<const f16*>(ch)[j]);
    for (int g = 0; g < f.block / f.group; ++g) {
      float s = d, o;
      if constexpr (f.header == 20) {
        s = d * static_cast<float>(ch[(4 + g) * kNR + j]);
        o = 0.f - to_float(reinterpret_cast<const f16*>(ch + 2 * kNR)[j]) * static_cast<float>(ch[(12 + g) * kNR + j]);
      } else if constexpr (T == int(QType::Q6_K)) {
        s = d * (static_cast<float>(ch[(2 + g) * kNR + j]) - 128.f);
        o = s * -32.f;
      } else if constexpr (f.offset_code == 0) {
        o = to_float(reinterpret_cast<const f16*>(ch + 2 * kNR)[j]);
      } else if constexpr (f.offset_code < 0) {
        o = 0.f - d * static_cast<float>(ch[2 * kNR + j]);
      } else {
        o = d * -static_cast<float>(f.offset_code);
      }
      const uint8_t* codes = ch + f.header * kNR;
      for (int r = g * f.group; r < (g + 1) * f.group; ++r) {
        int q;
        if (f.bits == 8) {
          q = codes[r * kNR + j];
        } else {
          q = (codes[(r >> 1) * kNR + j] >> (4 * (r & 1))) & 15;
          const uint8_t* hi = codes + (f.block / 2) * kNR;
          if (f.bits == 5) q |= ((hi[(r >> 3) * kNR + j] >> (r & 7)) & 1) << 4;
          if (f.bits == 6) q |= ((hi[(r >> 2) * kNR + j] >> (2 * (r & 3))) & 3) << 4;
        }
        out[b * f.block + r] = std::fma(s, static_cast<float>(q), o);
      }
    }
  }
}

template <int T>
void qrows_t(float* out, const uint8_t* w, const int64_t* ids, int64_t count, int64_t k) {
#pragma omp parallel for schedule(static) if (count * k > 65536)
  for (int64_t i = 0; i < count; ++i) q_row<T>(out + i * k, w, ids[i], k);
}

#define CPUSERVE_QTYPE_SWITCH(t, CALL) \
  switch (t) {                         \
    case 2: CALL(2); break;            \
    case 3: CALL(3); break;            \
    case 6: CALL(6); break;            \
    case 7: CALL(7); break;            \
    case 8: CALL(8); break;            \
    case 12: CALL(12); break;          \
    case 13: CALL(13); break;          \
    case 14: CALL(14); break;          \
    case 100: CALL(100); break;        \
    default: break;                    \
  }

void qgemm_impl(float* c, const float* a, const uint8_t* w, int t, const float* bias, int64_t m, int64_t n,
                int64_t k, int64_t lda, int64_t ldc) {
#define CPUSERVE_QGEMM(T) qgemm_t<T>(c, a, w, bias, m, n, k, lda, ldc)
  CPUSERVE_QTYPE_SWITCH(t, CPUSERVE_QGEMM)
#undef CPUSERVE_QGEMM
}

void qrows_impl(float* out, const uint8_t* w, int t, const int64_t* ids, int64_t count, int64_t k) {
#define CPUSERVE_QROWS(T) qrows_t<T>(out, w, ids, count, k)
  CPUSERVE_QTYPE_SWITCH(t, CPUSERVE_QROWS)
#undef CPUSERVE_QROWS
}

}  // namespace
}  // namespace cpuserve
