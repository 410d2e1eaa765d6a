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
//          5- and 6-bit types: [G / 4][2][4L] bytes, one code a byte, column h * L + l at [q][h][4l + j]
//   S      float [kI8NR], then O float [kI8NR]
// Codes of at most 6 bits are needed (u8 x s8 pair sums must fit int16 where maddubs does the
// products), so Q8_0 stays on the float path (qd_supported).
#pragma once
#include <cmath>
#include <cstring>
#include <vector>
#include "int8.hpp"
#include "quant.hpp"

namespace cpuserve {
namespace {

constexpr int kQdMR = 4;

constexpr bool qd_supported(int t) { return qformat(t).block != 0 && qformat(t).bits <= 6; }

constexpr int64_t qd_code_bytes(const QFormat& f) {
  return f.bits == 4 ? int64_t(f.group) * kI8NR / 2 : int64_t(f.group) * kI8NR;
}
constexpr int64_t qd_chunk_bytes(const QFormat& f) { return qd_code_bytes(f) + 2 * kI8NR * int64_t(sizeof(float)); }

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

// Byte offset of the code of column j (of the panel), element e of a group.
inline int64_t qd_code_at(const QFormat& f, int j, int e) {
  const int L = VecI8::L, h = j / L, l = j % L;
  return f.bits == 4 ? (e / 4) * 4 * L + l * 4 + e % 4 : (e / 4) * 8 * L + h * 4 * L + l * 4 + e % 4;
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
            chunk[qd_code_at(f, j, e)] |= f.bits == 4 ? static_cast<uint8_t>(u << (4 * (j / VecI8::L))) : u;
          }
          float s, o;
          qd_group_so(t, q, g, s, o);
          std::memcpy(chunk + qd_code_bytes(f) + 4 * j, &s, 4);
          std::memcpy(chunk + qd_code_bytes(f) + 4 * (kI8NR + j), &o, 4);
        }
      }
  }
}

// x [k] -> qa [k], and per group sa and sa * sum(qa). A group of zeros uses sa = 1.
inline void qd_quant_row(const float* x, int64_t k, int G, int8_t* qa, float* sa, float* sm) {
  for (int64_t g = 0; g < k / G; ++g) {
    const float* xg = x + g * G;
    float amax = 0.f;
    for (int i = 0; i < G; ++i) amax = std::max(amax, std::fabs(xg[i]));
    float s = amax / 127.f;
    if (!(s > 0.f)) s = 1.f;
    int32_t sum = 0;
    for (int i = 0; i < G; ++i) {
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xg[i] / s)));
      qa[g * G + i] = static_cast<int8_t>(v);
      sum += static_cast<int32_t>(v);
    }
    sa[g] = s;
    sm[g] = s * static_cast<float>(sum);
  }
}

struct QdRows {  // quantized activations: row r's codes at q + r * k, its groups' factors at r * ng
  const int8_t* q;
  const float* sa;
  const float* sm;
  int64_t k, ng;
};

// MR rows from `r` x one panel over all of k -> out [MR][kI8NR].
template <int G, bool NIB, int MR>
inline void qd_micro(const QdRows& A, int64_t r, const uint8_t* panel, float* out) {
  constexpr int L = VecI8::L, NF = kI8NR / VecF::N;
  constexpr QFormat f = {G, 0, G, NIB ? 4 : 6, 0, 0};
  constexpr int64_t code_bytes = qd_code_bytes(f), cb = qd_chunk_bytes(f);
  VecF acc_f[MR][NF];
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < NF; ++h) acc_f[i][h] = VecF::zero();
  const int8_t* qa = A.q + r * A.k;
  for (int64_t g = 0; g < A.ng; ++g) {
    const uint8_t* chunk = panel + g * cb;
    VecI8 acc[MR][2];
    for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = VecI8::zero();
    for (int q = 0; q < G / 4; ++q) {
      typename VecI8::W w0, w1;
      if constexpr (NIB) {
        VecI8::nibbles(VecI8::loadw(chunk + q * 4 * L), w0, w1);
      } else {
        w0 = VecI8::loadw(chunk + q * 8 * L);
        w1 = VecI8::loadw(chunk + q * 8 * L + 4 * L);
      }
      for (int i = 0; i < MR; ++i) {
        const typename VecI8::A a = VecI8::bcast_s(rd_i32(qa + i * A.k + g * G + 4 * q));
        acc[i][0] = VecI8::dotu(acc[i][0], w0, a);
        acc[i][1] = VecI8::dotu(acc[i][1], w1, a);
      }
    }
    const float* S = reinterpret_cast<const float*>(chunk + code_bytes);
    const float* O = S + kI8NR;
    alignas(64) int32_t ib[MR][kI8NR];
    for (int i = 0; i < MR; ++i) {
      acc[i][0].store(ib[i]);
      acc[i][1].store(ib[i] + L);
      const VecF sa = VecF::set1(A.sa[(r + i) * A.ng + g]), sm = VecF::set1(A.sm[(r + i) * A.ng + g]);
      for (int h = 0; h < NF; ++h)
        acc_f[i][h] = VecF::fma(VecF::i32(ib[i] + h * VecF::N), VecF::load(S + h * VecF::N) * sa,
                                VecF::fma(VecF::load(O + h * VecF::N), sm, acc_f[i][h]));
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < NF; ++h) acc_f[i][h].store(out + i * kI8NR + h * VecF::N);
}

// Rows [r, r + mr) x panel p of C.
template <int G, bool NIB>
inline void qd_tile(const QdRows& A, int mr, int64_t r, int64_t p, const uint8_t* w, int64_t ps, const float* bias,
                    float* c, int64_t n, int64_t ldc) {
  alignas(64) float out[kQdMR * kI8NR];
  const uint8_t* panel = w + p * ps;
  switch (mr) {
    case 4: qd_micro<G, NIB, 4>(A, r, panel, out); break;
    case 3: qd_micro<G, NIB, 3>(A, r, panel, out); break;
    case 2: qd_micro<G, NIB, 2>(A, r, panel, out); break;
    default: qd_micro<G, NIB, 1>(A, r, panel, out); break;
  }
  const int64_t c0 = p * kI8NR, cols = std::min<int64_t>(kI8NR, n - c0);
  for (int i = 0; i < mr; ++i) {
    float* cr = c + (r + i) * ldc + c0;
    for (int64_t j = 0; j < cols; ++j) cr[j] = out[i * kI8NR + j] + (bias != nullptr ? bias[c0 + j] : 0.f);
  }
}

template <int G, bool NIB>
void qd_gemm_t(float* c, const float* a, const uint8_t* w, const float* bias, int64_t m, int64_t n, int64_t k,
               int64_t lda, int64_t ldc) {
  const int64_t ng = k / G, panels = i8_panels(n);
  const int64_t ps = ng * qd_chunk_bytes(QFormat{G, 0, G, NIB ? 4 : 6, 0, 0});
  thread_local std::vector<int8_t> qbuf;
  thread_local std::vector<float> fbuf;
  qbuf.resize(static_cast<size_t>(m * k));
  fbuf.resize(static_cast<size_t>(2 * m * ng));
  int8_t* q = qbuf.data();  // the calling thread's buffers (thread_local), named before the parallel region
  float* sa = fbuf.data();
  float* sm = sa + m * ng;
#pragma omp parallel for schedule(static) if (m > 8)
  for (int64_t r = 0; r < m; ++r) qd_quant_row(a + r * lda, k, G, q + r * k, sa + r * ng, sm + r * ng);
  const QdRows A{q, sa, sm, k, ng};
  if (m <= kQdMR) {  // decode: every row against each panel as it streams by
#pragma omp parallel for schedule(static) if (n * k > 32768)
    for (int64_t p = 0; p < panels; ++p) qd_tile<G, NIB>(A, static_cast<int>(m), 0, p, w, ps, bias, c, n, ldc);
    return;
  }
  i8_schedule<kQdMR>(m, panels, w, ps, [&](int mr, int64_t r, int64_t p) {
    qd_tile<G, NIB>(A, mr, r, p, w, ps, bias, c, n, ldc);
  });
}

void qdgemm_impl(float* c, const float* a, const uint8_t* w, int t, const float* bias, int64_t m, int64_t n,
                 int64_t k, int64_t lda, int64_t ldc) {
  const QFormat f = qformat(t);
  if (!qd_supported(t)) return;
  if (f.group == 16) qd_gemm_t<16, false>(c, a, w, bias, m, n, k, lda, ldc);
  else if (f.bits == 4) qd_gemm_t<32, true>(c, a, w, bias, m, n, k, lda, ldc);
  else qd_gemm_t<32, false>(c, a, w, bias, m, n, k, lda, ldc);
}

// out[i, :k] = row ids[i], fma(S, u, O): the float path's values bit for bit (embedding lookups).
void qdrows_impl(float* out, const uint8_t* w, int t, const int64_t* ids, int64_t count, int64_t k) {
  const QFormat f = qformat(t);
  if (!qd_supported(t)) return;
  const int G = f.group;
  const int64_t ng = k / G, cb = qd_chunk_bytes(f), cbytes = qd_code_bytes(f);
#pragma omp parallel for schedule(static) if (count * k > 65536)
  for (int64_t i = 0; i < count; ++i) {
    const int64_t id = ids[i];
    const int j = static_cast<int>(id % kI8NR), h = j / VecI8::L;
    const uint8_t* panel = w + (id / kI8NR) * ng * cb;
    for (int64_t g = 0; g < ng; ++g) {
      const uint8_t* chunk = panel + g * cb;
      float s, o;
      std::memcpy(&s, chunk + cbytes + 4 * j, 4);
      std::memcpy(&o, chunk + cbytes + 4 * (kI8NR + j), 4);
      for (int e = 0; e < G; ++e) {
        const uint8_t b = chunk[qd_code_at(f, j, e)];
        const int u = f.bits == 4 ? (b >> (4 * h)) & 15 : b;
        out[i * k + g * G + e] = std::fma(s, static_cast<float>(u), o);
      }
    }
  }
}

}  // namespace
}  // namespace cpuserve
