// GEMM on GGUF block-quantized weights with int8 dot products (opt in: --gguf-int8-activations),
// llama.cpp's scheme (its Q8_1 / Q8_K activations): each weight keeps its unsigned code u and
// its group's float32 scale S and offset O (W = S * u + O, the values the float path decodes),
// the activations are quantized to int8 per group of G consecutive k, and
//
//   C[m, n] = sum_g  S[n, g] * sa[m, g] * sum_{k in g} u[n, k] * qa[m, k]
//                  + O[n, g] * sa[m, g] * sum_{k in g} qa[m, k]                    (+ bias[n])
//
//   sa[m, g] = max_{k in g} |x[m, k]| / 127,   qa[m, k] = rne(x[m, k] / sa[m, g])  in [-127, 127]
//
// G is the type's group (32; 16 for Q6_K). The integer sums are exact and the float epilogue is
// the same fused multiply-adds, group by group, on every ISA and for every row tile: every table
// gives the same bits, and a row's result does not depend on its batch. Against the float path
// only the activations' rounding differs (the weights are the same numbers).
//
// Packed weight: panels of kI8NR columns, for panel p and group g one chunk:
//   codes  4-bit types: [G / 4][4L] bytes, byte 4l + j of row q: the code of column l for
//          k = 4q + j in the low nibble, of column L + l in the high nibble (one load, two vectors)
//          5-bit types: [G / 4][5L] bytes, the 4-bit layout's 4L bytes of low nibbles, then L bytes of
//          their fifth bits: bit b of the first L / 2 bytes for byte b's low nibble, of the next
//          L / 2 for its high nibble (Q5_0: 5.5 bits a weight with its float16 S, as in the file)
//          6-bit types: [G / 8][12L] bytes, two rows q = 2p, 2p + 1 at a time: each row's 4L bytes of
//          nibbles as the 4-bit layout's, then 4L bytes of their bits 4-5: byte 4l + j holds, from
//          bit 0 up, those of columns l and L + l of row 2p, then of row 2p + 1 (Q6_K: with its
//          float32 S alone, 8 bits a weight, where a byte a code and S and O took 12; the file 6.56)
//          8-bit types: [G / 4][2][4L] bytes, one code a byte, column h * L + l at [q][h][4l + j]
//   S      [kI8NR], then O [kI8NR]: float32, or the blocks' float16 where that is the same number
//          (qd_fac: O not stored where it is -offset_code * S, as in Q6_K, or for 8-bit codes)
// 8-bit codes (Q8_0: u = q + 128, O = -128 S) are summed as sum (u - 128) * qa, so their epilogue
// is S * sa * sum q * qa alone: u8 x s8 pairs of such codes overflow int16 where maddubs does the
// products, so each ISA's VecI8::dotu8 takes its own route to that exact sum (VNNI's vpdpbusd on u,
// less 128 * sum qa; elsewhere q's magnitude and sign). Q8_0 holds the default GGUF's tied
// embedding / LM head.
#pragma once
#include <cmath>
#include <cstring>
#include <vector>
#include "int8.hpp"
#include "quant.hpp"

namespace cpuserve {
namespace {

constexpr int kQdMR = 4;

constexpr bool qd_supported(int t) { return qformat(t).block != 0; }  // every kept block type

constexpr int64_t qd_code_bytes(const QFormat& f) { return int64_t(f.group) * kI8NR * f.bits / 8; }
constexpr bool qd_nibbles(const QFormat& f) { return f.bits >= 4 && f.bits <= 6; }

// How a chunk keeps its groups' S and O: float32 where they are products (K-quants: d times a
// sub-block scale; Q4_ZP: -z d), S alone where O = -offset_code * S (Q6_K: O = -32 S, the same
// float32 product at run time), else the block's own float16 bits, which are the same numbers: S
// and O both where O is the block's min (Q4_1, Q5_1), S alone where O = -offset_code * S (Q4_0,
// Q5_0) or where 8-bit codes need no O (Q8_0).
// Q4_K's S and O formed in the kernel from its float16 d and dmin and u8 sub-block scale and min
// (6 bytes a column a group against 8: 5.5 bits a weight against 6) was level at batch 1 and cost
// the batch path, which forms them again for each row tile (AMD EPYC Zen 4, the Q4_K_M file's
// ffn_down GEMVs in turns: 24.0 against 24.3 us a call): not taken.
enum QdFactors { kQdF32 = 0, kQdF16SO = 1, kQdF16S = 2, kQdF32S = 3 };
constexpr int qd_fac(const QFormat& f) {
  if (f.offset_code < 0 || (f.block != f.group && f.offset_code == 0)) return kQdF32;
  if (f.block != f.group) return kQdF32S;
  return f.offset_code == 0 ? kQdF16SO : kQdF16S;
}
constexpr int64_t qd_factor_bytes(const QFormat& f) {
  constexpr int bytes[] = {8, 4, 2, 4};
  return kI8NR * bytes[qd_fac(f)];
}
constexpr int64_t qd_chunk_bytes(const QFormat& f) { return qd_code_bytes(f) + qd_factor_bytes(f); }

// Factor i (0: S, 1: O) of column j, as the float path's float32 value.
inline float qd_factor(const QFormat& f, const uint8_t* chunk, int i, int j) {
  const uint8_t* at = chunk + qd_code_bytes(f);
  if (i == 1 && (qd_fac(f) == kQdF16S || qd_fac(f) == kQdF32S))
    return qd_factor(f, chunk, 0, j) * -static_cast<float>(f.offset_code);
  if (qd_fac(f) == kQdF32 || qd_fac(f) == kQdF32S) {
    float v;
    std::memcpy(&v, at + 4 * (i * kI8NR + j), 4);
    return v;
  }
  uint16_t b;
  std::memcpy(&b, at + 2 * (i * kI8NR + j), 2);
  return to_float(f16{b});
}

int64_t qdpacked_bytes_impl(int t, int64_t n, int64_t k) {
  const QFormat f = qformat(t);
  if (!qd_supported(t) || k % f.block != 0) return -1;
  return i8_panels(n) * (k / f.group) * qd_chunk_bytes(f);
}

// S and O of group g of an unpacked block: the same float32 operations as group_so / q_row.
inline void qd_group_so(int t, const QBlock& q, int g, float& s, float& o) {
  const QFormat f = qformat(t);
  const float d = to_float(f16{q.d});
  s = d;
  if (f.header == 20) {  // Q4_K, Q5_K
    s = d * static_cast<float>(q.sc[g]);
    o = 0.f - to_float(f16{q.m}) * static_cast<float>(q.mn[g]);
  } else if (t == int(QType::Q6_K)) {
    s = d * (static_cast<float>(q.sc[g]) - 128.f);
    o = s * -32.f;
  } else if (f.offset_code == 0) {  // Q4_1, Q5_1
    o = to_float(f16{q.m});
  } else if (f.offset_code < 0) {  // Q4_ZP
    o = 0.f - d * static_cast<float>(q.sc[0]);
  } else {
    o = d * -static_cast<float>(f.offset_code);
  }
}

// Byte offset of the code of column j (of the panel), element e of a group (for 4, 5 and 6 bits:
// of its low nibble, the high one where j / L is 1).
inline int64_t qd_code_at(const QFormat& f, int j, int e) {
  const int L = VecI8::L, h = j / L, l = j % L;
  if (f.bits == 6) return (e / 8) * 12 * L + (e / 4 % 2) * 4 * L + l * 4 + e % 4;
  if (qd_nibbles(f)) return (e / 4) * (f.bits == 5 ? 5 : 4) * L + l * 4 + e % 4;
  return (e / 4) * 8 * L + h * 4 * L + l * 4 + e % 4;
}

// 6 bits: the byte of bits 4-5 of that code, and the shift of its two bits there.
inline int64_t qd_high_two_at(int j, int e, int& shift) {
  const int L = VecI8::L;
  shift = 2 * (j / L) + 4 * (e / 4 % 2);
  return (e / 8) * 12 * L + 8 * L + (j % L) * 4 + e % 4;
}

// 5 bits: the byte and the bit of the fifth bit of that code.
inline int64_t qd_high_bit_at(int j, int e, int& bit) {
  const int L = VecI8::L, b = (j / L) * 4 * L + (j % L) * 4 + e % 4;
  bit = b % 8;
  return (e / 4) * 5 * L + 4 * L + b / 8;
}

// dst: qdpacked_bytes bytes; src: n rows of k / B GGUF blocks (fields in host byte order).
void qdpack_impl(uint8_t* dst, const uint8_t* src, int t, int64_t n, int64_t k) {
  const QFormat f = qformat(t);
  const int G = f.group, per_block = f.block / G;
  const int64_t nb = k / f.block, ng = k / G, cb = qd_chunk_bytes(f), panels = i8_panels(n);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    QBlock q;
    uint8_t* panel = dst + p * ng * cb;
    std::memset(panel, 0, static_cast<size_t>(ng * cb));
    for (int j = 0; j < kI8NR && p * kI8NR + j < n; ++j)
      for (int64_t b = 0; b < nb; ++b) {
        unpack_gguf(t, src + ((p * kI8NR + j) * nb + b) * f.gguf_bytes, q);
        for (int g = 0; g < per_block; ++g) {
          uint8_t* chunk = panel + (b * per_block + g) * cb;
          for (int e = 0; e < G; ++e) {
            const uint8_t u = q.u[g * G + e];
            chunk[qd_code_at(f, j, e)] |= qd_nibbles(f) ? static_cast<uint8_t>((u & 15) << (4 * (j / VecI8::L))) : u;
            if (f.bits == 5 && (u & 16)) {
              int bit;
              chunk[qd_high_bit_at(j, e, bit)] |= static_cast<uint8_t>(1 << bit);
            }
            if (f.bits == 6) {
              int shift;
              chunk[qd_high_two_at(j, e, shift)] |= static_cast<uint8_t>(((u >> 4) & 3) << shift);
            }
          }
          uint8_t* at = chunk + qd_code_bytes(f);
          if (qd_fac(f) == kQdF32 || qd_fac(f) == kQdF32S) {
            float s, o;
            qd_group_so(t, q, g, s, o);
            std::memcpy(at + 4 * j, &s, 4);
            if (qd_fac(f) == kQdF32) std::memcpy(at + 4 * (kI8NR + j), &o, 4);
          } else {  // the block's float16 d (and m): qd_group_so's S (and O) exactly
            std::memcpy(at + 2 * j, &q.d, 2);
            if (qd_fac(f) == kQdF16SO) std::memcpy(at + 2 * (kI8NR + j), &q.m, 2);
          }
        }
      }
  }
}

// x [k] -> qa [k], and per group sa, sa * sum(qa) and sum(qa). A group of zeros uses sa = 1. The
// codes as W8A8's (int8.hpp: i8_abs_max, i8_codes, in vectors on AVX-512 and AVX2).
inline void qd_quant_row(const float* x, int64_t k, int G, int8_t* qa, float* sa, float* sm, int32_t* si) {
  for (int64_t g = 0; g < k / G; ++g) {
    const float* xg = x + g * G;
    int8_t* q = qa + g * G;
    float s = i8_abs_max(xg, G) / 127.f;
    if (!(s > 0.f)) s = 1.f;
    i8_codes(xg, G, s, 0, q);
    int32_t sum = 0;
    for (int i = 0; i < G; ++i) sum += q[i];
    sa[g] = s;
    sm[g] = s * static_cast<float>(sum);
    si[g] = sum;
  }
}

struct QdRows {  // quantized activations: row r's codes at q + r * k, its groups' factors at r * ng
  const int8_t* q;
  const float* sa;
  const float* sm;
  const int32_t* si;
  int64_t k, ng;
};

// How a chunk holds its codes: nibbles (4 bits), nibbles and fifth bits (5), nibbles and bits 4-5
// (6), 8-bit (u = q + 128).
enum QdCodes { kQdNib = 4, kQdNib5 = 5, kQdNib6 = 6, kQdU8 = 8 };

// Bytes ahead of its stream that the decode path fetches each chunk (into L2): the hardware
// prefetchers alone ran too close behind. Batch-1 int8 GEMMs of the Q4_K_M file, AMD EPYC Zen 4,
// the distances taking turns in one process (medians of 30): none 8.42-8.43 ms, 1 KB 7.90, 2 KB
// 7.55, 3 KB 7.72, 4.5 KB 7.27-7.49, 6 KB 8.11, 9 KB 8.29; the default Q4_1 file 6.47 -> 6.15.
constexpr int64_t kQdAhead = 4608;

// The group's S and O (float32) of columns [h N, (h + 1) N) of a chunk's factors.
template <int T>
inline void qd_so(const uint8_t* at, int h, VecF& s, VecF& o) {
  constexpr QFormat f = qformat(T);
  if constexpr (qd_fac(f) == kQdF32S) {
    s = VecF::load(reinterpret_cast<const float*>(at) + h * VecF::N);
    o = s * VecF::set1(-static_cast<float>(f.offset_code));
  } else if constexpr (qd_fac(f) == kQdF32) {
    s = VecF::load(reinterpret_cast<const float*>(at) + h * VecF::N);
    o = VecF::load(reinterpret_cast<const float*>(at) + kI8NR + h * VecF::N);
  } else {
    s = VecF::load(reinterpret_cast<const f16*>(at) + h * VecF::N);
    if constexpr (qd_fac(f) == kQdF16SO) o = VecF::load(reinterpret_cast<const f16*>(at) + kI8NR + h * VecF::N);
    else o = s * VecF::set1(-static_cast<float>(f.offset_code));  // 8-bit codes: unused
  }
}

// MR rows from `r` x one panel over all of k -> out [MR][kI8NR]. `ahead` > 0 (decode): each chunk's
// lines are fetched `ahead` bytes on, past the panel's end into the panel the thread takes next,
// which starts `then` bytes from this one.
template <int T, int MR>
inline void qd_micro(const QdRows& A, int64_t r, const uint8_t* panel, float* out, int64_t ahead, int64_t then) {
  constexpr int L = VecI8::L, NF = kI8NR / VecF::N;
  constexpr QFormat f = qformat(T);
  constexpr int G = f.group, CODES = f.bits == 4 ? kQdNib : f.bits == 5 ? kQdNib5 : f.bits == 6 ? kQdNib6 : kQdU8;
  constexpr int64_t code_bytes = qd_code_bytes(f), cb = qd_chunk_bytes(f);
  VecF acc_f[MR][NF];
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < NF; ++h) acc_f[i][h] = VecF::zero();
  const int8_t* qa = A.q + r * A.k;
  for (int64_t g = 0; g < A.ng; ++g) {
    const uint8_t* chunk = panel + g * cb;
    if (ahead > 0)
      for (int64_t at = g * cb + ahead; at < (g + 1) * cb + ahead; at += 64)
        prefetch_l2(panel + (at < A.ng * cb ? at : then + at - A.ng * cb));
    VecI8 acc[MR][2];
    for (int i = 0; i < MR; ++i) {
      // 8-bit codes: sum (u - 128) * qa, where dotu8 leaves kU8Bias * sum qa to take off
      const int32_t start = CODES == kQdU8 ? -VecI8::kU8Bias * A.si[(r + i) * A.ng + g] : 0;
      acc[i][0] = acc[i][1] = VecI8::set1(start);
    }
    for (int q = 0; q < G / 4; ++q) {
      typename VecI8::W w0, w1;
      if constexpr (CODES == kQdNib || CODES == kQdNib5) {
        const uint8_t* codes = chunk + q * (CODES == kQdNib5 ? 5 : 4) * L;
        VecI8::nibbles(VecI8::loadw(codes), w0, w1);
        if constexpr (CODES == kQdNib5) VecI8::high_bits(w0, w1, codes + 4 * L);
      } else if constexpr (CODES == kQdNib6) {
        const uint8_t* pair = chunk + (q / 2) * 12 * L;
        VecI8::nibbles(VecI8::loadw(pair + (q % 2) * 4 * L), w0, w1);
        if (q % 2 == 0) VecI8::template high_two<0>(w0, w1, VecI8::loadw(pair + 8 * L));
        else VecI8::template high_two<4>(w0, w1, VecI8::loadw(pair + 8 * L));
      } else {
        w0 = VecI8::loadw(chunk + q * 8 * L);
        w1 = VecI8::loadw(chunk + q * 8 * L + 4 * L);
      }
      if constexpr (CODES == kQdU8) {
        const typename VecI8::W8 v0 = VecI8::codes8(w0), v1 = VecI8::codes8(w1);
        for (int i = 0; i < MR; ++i) {
          const typename VecI8::A a = VecI8::bcast_s(rd_i32(qa + i * A.k + g * G + 4 * q));
          acc[i][0] = VecI8::dotu8(acc[i][0], v0, a);
          acc[i][1] = VecI8::dotu8(acc[i][1], v1, a);
        }
      } else {
        for (int i = 0; i < MR; ++i) {
          const typename VecI8::A a = VecI8::bcast_s(rd_i32(qa + i * A.k + g * G + 4 * q));
          acc[i][0] = VecI8::dotu(acc[i][0], w0, a);
          acc[i][1] = VecI8::dotu(acc[i][1], w1, a);
        }
      }
    }
    VecF S[NF], O[NF];
    for (int h = 0; h < NF; ++h) qd_so<T>(chunk + code_bytes, h, S[h], O[h]);
    alignas(64) int32_t ib[MR][kI8NR];
    for (int i = 0; i < MR; ++i) {
      acc[i][0].store(ib[i]);
      acc[i][1].store(ib[i] + L);
      const VecF sa = VecF::set1(A.sa[(r + i) * A.ng + g]), sm = VecF::set1(A.sm[(r + i) * A.ng + g]);
      for (int h = 0; h < NF; ++h) {
        const VecF base = CODES == kQdU8 ? acc_f[i][h] : VecF::fma(O[h], sm, acc_f[i][h]);
        acc_f[i][h] = VecF::fma(VecF::i32(ib[i] + h * VecF::N), S[h] * sa, base);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < NF; ++h) acc_f[i][h].store(out + i * kI8NR + h * VecF::N);
}

// qd_micro for a run-time mr <= kQdMR.
template <int T>
inline void qd_micro_rows(const QdRows& A, int mr, int64_t r, const uint8_t* panel, float* out, int64_t ahead,
                          int64_t then) {
  switch (mr) {
    case 4: return qd_micro<T, 4>(A, r, panel, out, ahead, then);
    case 3: return qd_micro<T, 3>(A, r, panel, out, ahead, then);
    case 2: return qd_micro<T, 2>(A, r, panel, out, ahead, then);
    default: return qd_micro<T, 1>(A, r, panel, out, ahead, then);
  }
}

// Rows [r, r + mr) x panel p of C (decode: the thread's next panel is p + 1).
template <int T>
inline void qd_tile(const QdRows& A, int mr, int64_t r, int64_t p, const uint8_t* w, int64_t ps, const float* bias,
                    float* c, int64_t n, int64_t ldc, int64_t ahead = 0) {
  alignas(64) float out[kQdMR * kI8NR];
  qd_micro_rows<T>(A, mr, r, w + p * ps, out, ahead, ps);
  const int64_t c0 = p * kI8NR, cols = std::min<int64_t>(kI8NR, n - c0);
  for (int i = 0; i < mr; ++i) {
    float* cr = c + (r + i) * ldc + c0;
    for (int64_t j = 0; j < cols; ++j) cr[j] = out[i * kI8NR + j] + (bias != nullptr ? bias[c0 + j] : 0.f);
  }
}

// A's m rows quantized per group of G (qd_quant_row) into the calling thread's buffers.
inline QdRows qd_rows_of(const float* a, int64_t m, int64_t k, int64_t lda, int G) {
  const int64_t ng = k / G;
  thread_local std::vector<int8_t> qbuf;
  thread_local std::vector<float> fbuf;
  thread_local std::vector<int32_t> ibuf;
  qbuf.resize(static_cast<size_t>(m * k));
  fbuf.resize(static_cast<size_t>(2 * m * ng));
  ibuf.resize(static_cast<size_t>(m * ng));
  int8_t* q = qbuf.data();  // the calling thread's buffers (thread_local), named before the parallel region
  float* sa = fbuf.data();
  float* sm = sa + m * ng;
  int32_t* si = ibuf.data();
#pragma omp parallel for schedule(static) if (m > 8)
  for (int64_t r = 0; r < m; ++r) qd_quant_row(a + r * lda, k, G, q + r * k, sa + r * ng, sm + r * ng, si + r * ng);
  return QdRows{q, sa, sm, si, k, ng};
}

template <int T>
void qd_gemm_t(float* c, const float* a, const uint8_t* w, const float* bias, int64_t m, int64_t n, int64_t k,
               int64_t lda, int64_t ldc) {
  const QdRows A = qd_rows_of(a, m, k, lda, qformat(T).group);
  const int64_t panels = i8_panels(n), ps = A.ng * qd_chunk_bytes(qformat(T));
  if (m <= kQdMR) {  // decode: every row against each panel as it streams by
    share_tiles(1, panels, 4, n * k > 32768, [&](int64_t, int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) qd_tile<T>(A, static_cast<int>(m), 0, p, w, ps, bias, c, n, ldc, kQdAhead);
    });
    return;
  }
  i8_schedule<kQdMR>(m, panels, w, ps, [&](int mr, int64_t r, int64_t p) {
    qd_tile<T>(A, mr, r, p, w, ps, bias, c, n, ldc);
  });
}

void qdgemm_impl(float* c, const float* a, const uint8_t* w, int t, const float* bias, int64_t m, int64_t n,
                 int64_t k, int64_t lda, int64_t ldc) {
  if (!qd_supported(t)) return;
  switch (static_cast<QType>(t)) {
    case QType::Q4_0: return qd_gemm_t<int(QType::Q4_0)>(c, a, w, bias, m, n, k, lda, ldc);
    case QType::Q4_1: return qd_gemm_t<int(QType::Q4_1)>(c, a, w, bias, m, n, k, lda, ldc);
    case QType::Q5_0: return qd_gemm_t<int(QType::Q5_0)>(c, a, w, bias, m, n, k, lda, ldc);
    case QType::Q5_1: return qd_gemm_t<int(QType::Q5_1)>(c, a, w, bias, m, n, k, lda, ldc);
    case QType::Q8_0: return qd_gemm_t<int(QType::Q8_0)>(c, a, w, bias, m, n, k, lda, ldc);
    case QType::Q4_K: return qd_gemm_t<int(QType::Q4_K)>(c, a, w, bias, m, n, k, lda, ldc);
    case QType::Q5_K: return qd_gemm_t<int(QType::Q5_K)>(c, a, w, bias, m, n, k, lda, ldc);
    case QType::Q6_K: return qd_gemm_t<int(QType::Q6_K)>(c, a, w, bias, m, n, k, lda, ldc);
    case QType::Q4_ZP: return qd_gemm_t<int(QType::Q4_ZP)>(c, a, w, bias, m, n, k, lda, ldc);
  }
}

// out[i, :k] = row ids[i], fma(S, u, O): the float path's values bit for bit (embedding lookups).
void qdrows_impl(float* out, const uint8_t* w, int t, const int64_t* ids, int64_t count, int64_t k) {
  const QFormat f = qformat(t);
  if (!qd_supported(t)) return;
  const int G = f.group;
  const int64_t ng = k / G, cb = qd_chunk_bytes(f);
#pragma omp parallel for schedule(static) if (count * k > 65536)
  for (int64_t i = 0; i < count; ++i) {
    const int64_t id = ids[i];
    const int j = static_cast<int>(id % kI8NR), h = j / VecI8::L;
    const uint8_t* panel = w + (id / kI8NR) * ng * cb;
    for (int64_t g = 0; g < ng; ++g) {
      const uint8_t* chunk = panel + g * cb;
      const float s = qd_factor(f, chunk, 0, j), o = f.bits == 8 ? 0.f : qd_factor(f, chunk, 1, j);
      for (int e = 0; e < G; ++e) {
        const uint8_t b = chunk[qd_code_at(f, j, e)];
        int u = qd_nibbles(f) ? (b >> (4 * h)) & 15 : b - 128;
        if (f.bits == 5) {
          int bit;
          u |= ((chunk[qd_high_bit_at(j, e, bit)] >> bit) & 1) << 4;
        }
        if (f.bits == 6) {
          int shift;
          u |= ((chunk[qd_high_two_at(j, e, shift)] >> shift) & 3) << 4;
        }
        // 8-bit: S * q, the float path's fma(S, u, -128 S) (S q exact before its one rounding)
        out[i * k + g * G + e] = std::fma(s, static_cast<float>(u), o);
      }
    }
  }
}

}  // namespace
}  // namespace cpuserve
