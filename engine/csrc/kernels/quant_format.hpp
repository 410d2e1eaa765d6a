// GGUF block quantization formats as this engine keeps them in memory.
//
// A GGUF tensor [N, K] stores each row as blocks of B weights (B = 32, or 256
// for the K-quants). At load the blocks are regrouped, without widening, into
// panels of NR output rows (the GEMM's panel width), so that one weight row k
// of a panel (NR columns of W^T) decodes into two vectors with a load, a shift
// and a convert. For panel p and block b, the NR columns' data is one chunk:
//
//   header  per column: f16 d; f16 m / dmin (Q4_1, Q5_1, K-quants) or u8 zero point (Q4_ZP);
//           u8 sub-block scales and mins (K-quants), each as [groups][NR]
//   codes   low nibbles, two rows per byte:       [B / 2][NR]
//           then Q5: the fifth bit, 8 rows a byte: [B / 8][NR]
//                Q6_K: bits 5-6, 4 rows a byte:    [B / 4][NR]
//           Q8_0 instead: one byte per weight:     [B][NR]
//
// Every weight is decoded as fma(S, q, O) with q its unsigned code and S, O
// its group's scale and offset in float32, which reproduces the reference
// dequantization (ggml / gguf-py) bit for bit: d*(q-8) == fma(d, q, -8d) and
// d*sc*q - dmin*m == fma(d*sc, q, -(dmin*m)) exactly, the products being exact.
// The panel bytes equal the file's but for the K-quants' unpacked 6-bit scales.
#pragma once
#include <cstdint>

namespace cpuserve {

// ggml's type ids, so Python passes gguf.GGMLQuantizationType values through.
enum class QType : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
                         // Not a ggml type: 4-bit codes with a float16 scale and a 4-bit zero point per
                         // 32 weights, d * (q - z): AWQ and GPTQ checkpoints, regrouped at load. Its
                         // blocks: f16 d, u8 z, u8 0, 16 bytes of codes as Q4_0's (20 bytes).
                         Q4_ZP = 100 };

struct QFormat {
  int block;        // weights per block along K (B)
  int gguf_bytes;   // bytes of one GGUF block
  int group;        // rows sharing one scale and offset
  int bits;         // code width: 4, 5, 6 or 8
  int header;       // header bytes per column per block
  int offset_code;  // O = -offset_code * S for the symmetric types (0: O read from the header;
                    // -1: O = -z * S with the zero point z in the header)
};

constexpr QFormat kNoFormat = {0, 0, 0, 0, 0, 0};

constexpr QFormat qformat(int t) {
  switch (static_cast<QType>(t)) {
    case QType::Q4_0: return {32, 18, 32, 4, 2, 8};
    case QType::Q4_1: return {32, 20, 32, 4, 4, 0};
    case QType::Q5_0: return {32, 22, 32, 5, 2, 16};
    case QType::Q5_1: return {32, 24, 32, 5, 4, 0};
    case QType::Q8_0: return {32, 34, 32, 8, 2, 128};
    case QType::Q4_K: return {256, 144, 32, 4, 20, 0};
    case QType::Q5_K: return {256, 176, 32, 5, 20, 0};
    case QType::Q6_K: return {256, 210, 16, 6, 18, 32};
    case QType::Q4_ZP: return {32, 20, 32, 4, 3, -1};
  }
  return kNoFormat;
}

// Code bytes per column per block.
constexpr int qcode_bytes(const QFormat& f) {
  return f.bits == 8 ? f.block : f.block / 2 + (f.bits == 5 ? f.block / 8 : f.bits == 6 ? f.block / 4 : 0);
}

// Bytes of one (panel, block) chunk, and of a whole packed [N, K] weight.
constexpr int64_t qchunk_bytes(const QFormat& f, int nr) { return int64_t(nr) * (f.header + qcode_bytes(f)); }

constexpr int64_t qpacked_bytes(int t, int64_t n, int64_t k, int nr) {
  return qformat(t).block == 0 ? -1
                               : (n + nr - 1) / nr * (k / qformat(t).block) * qchunk_bytes(qformat(t), nr);
}

}  // namespace cpuserve
