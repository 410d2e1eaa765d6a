// bfloat16 and W8A8 GEMMs on AMX tiles (the amx table: Intel Sapphire Rapids and later). Weights are
// the bf16 pair panels of gemm.hpp (kNR columns of (k, k + 1) pairs a K row, 128 bytes) with K
// padded to whole tiles of 16 pairs (packed_pairs); A is rounded to bfloat16 (nearest even) as on the
// avx512_bf16 table. One step of the micro-kernel multiplies up to 32 rows by one panel: C tiles
// 0-3 (two row tiles of up to 16 rows by two halves of 16 columns), A tiles 4-5 (16 pairs of up
// to 16 rows), B tiles 6-7 (the panel's two halves, 16 pairs a tile, read in place at a 128-byte
// stride).
//
// W8A8 (int8.hpp) runs on the same tiles: its panels are kNR columns of 4 consecutive k a K row
// (128 bytes), K padded to whole tiles of 64 (i8_kpad), and tdpbssd's sums are exact.
//
// Batch invariance: tdpbf16ps' sum inside a tile step is not vdpbf16ps' (its rounding is not
// documented; measured here, 39% of random outputs differ from the pair chain in their last
// bits), so on this table every bfloat16 GEMM runs on tiles, one row or 2,048: each output is
// the same sequence of tile steps over K in increasing order, whatever M, the row tiling or the
// thread count.
#pragma once
#ifdef __AMX_BF16__
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>
#include "activation.hpp"
#include "gemm.hpp"
#include "int8.hpp"
#include "line_vector.hpp"
#include "prefetch.hpp"
#include "shares.hpp"

namespace cpuserve {
namespace {

constexpr int64_t kTilePairs = 16;  // k pairs a tile row holds (64 bytes)
constexpr int64_t kAmxRows = 32;    // rows a micro-kernel step takes (two row tiles)
static_assert(kNR == 32, "a panel is two 16-column tiles");

static_assert(kBf16KAlign == 2 * kTilePairs, "bf16 weights packed in whole tiles (gemm.hpp packed_pairs)");

// Tiles of rows0 rows (C 0-1, A 4) and rows1 rows (C 2-3, A 5; 0: unused) for one micro-kernel
// shape; B tiles 6-7 are 16 pairs of 16 columns. ldtilecfg zeroes every tile.
inline void amx_configure(int rows0, int rows1) {
  struct alignas(64) Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg{};
  cfg.palette = 1;
  const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, kTilePairs, kTilePairs};
  for (int t = 0; t < 8; ++t)
    if (rows[t] > 0) cfg.rows[t] = static_cast<uint8_t>(rows[t]), cfg.colsb[t] = 64;
  // Not _tile_loadconfig(&cfg): GCC 12's declares the asm's operand as one pointer's 8 bytes, so
  // to the optimizer the other stores into cfg are dead; inlined into a caller that sees the whole
  // struct, -O3 dropped the column widths and ldtilecfg faulted (a #GP: SIGSEGV). The operand here
  // is all 64 bytes.
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

// The output lines of the block a caller writes next (rows of a panel's kNR floats, two cache lines
// each, `ld` bytes apart), which amx_panel fetches into L2 (prefetcht1) spread over its tile steps.
// A tile store into lines in no nearer cache waits on each line's read for ownership, and the tiles
// wait behind the store: a prefill's outputs (2,048 rows by up to 3,072 floats, 5-25 MiB) have left
// the L2 since they were last written. Two threads, old and new in one binary taking turns, C on
// line boundaries: 2,048 x 960 x 576 1,477 -> 1,657 GFLOP/s with C in L3, 1,141 -> 1,724 with C in
// memory; x 3,072 x 576 2,247 -> 2,425 and 1,381 -> 1,975; x 576 x 1,536 2,177 -> 2,258 and
// 1,576 -> 1,788. (The gated kernels write through buffers with vector stores: no gain there.)
struct NextOut {
  const void* p = nullptr;
  int64_t ld = 0;
  int rows = 0;
};

// Rows [0, mr) (mr <= 32, tiles configured for them) of A times one panel, both in 4-byte units
// (bfloat16 pairs, or int8 quads on kInt8: tdpbssd's exact int32 sums), A's rows lda units apart,
// the panel kNR columns of units a k row, over k4 units; into out (mr rows of 32 floats or int32,
// ldo 4-byte units apart), fetching `next`'s lines on the way.
template <bool kTwo, bool kInt8>
inline void amx_panel(const void* a, int64_t lda, const void* b, int64_t k4, void* out, int64_t ldo,
                      const NextOut& next, const Prefetch& ahead) {
  const char* ap = static_cast<const char*>(a);
  const char* bp = static_cast<const char*>(b);
  char* op = static_cast<char*>(out);
  constexpr int64_t kRow = kNR * 4;  // bytes of a panel's k row
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwo) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const char* np = static_cast<const char*>(next.p);
  const int64_t steps = k4 / kTilePairs, lines = 2 * next.rows;
  int64_t line = 0;
  int64_t fetched = 0;
  for (int64_t q = 0, step = 1; q < k4; q += kTilePairs, ++step) {
    for (const int64_t until = lines * step / steps; line < until; ++line)
      _mm_prefetch(np + (line >> 1) * next.ld + (line & 1) * 64, _MM_HINT_T1);
    for (const int64_t until = ahead.count * step / steps; fetched < until; ++fetched) ahead.line(ahead.first + fetched);
    _tile_loadd(4, ap + q * 4, lda * 4);
    _tile_loadd(6, bp + q * kRow, kRow);
    _tile_loadd(7, bp + q * kRow + 64, kRow);
    if constexpr (kInt8) {  // (GCC's tile intrinsics take the tile numbers as literal text)
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (kTwo) {
      _tile_loadd(5, ap + 16 * lda * 4 + q * 4, lda * 4);
      if constexpr (kInt8) {
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      } else {
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  _tile_stored(0, op, ldo * 4);
  _tile_stored(1, op + 64, ldo * 4);
  if constexpr (kTwo) {
    _tile_stored(2, op + 16 * ldo * 4, ldo * 4);
    _tile_stored(3, op + 16 * ldo * 4 + 64, ldo * 4);
  }
}

// amx_panel for mr rows, configuring the tiles where the shape changes (`shape` holds the current
// one for this work item; 0 before the first); out's rows ldo units apart (a buffer's kNR).
template <bool kInt8 = false>
inline void amx_rows(int mr, const void* a, int64_t lda, const void* b, int64_t k4, void* out, int& shape,
                     int64_t ldo = kNR, const NextOut& next = {}, const Prefetch& ahead = {}) {
  if (shape != mr) {
    amx_configure(std::min(mr, 16), std::max(mr - 16, 0));
    shape = mr;
  }
  if (mr > 16) amx_panel<true, kInt8>(a, lda, b, k4, out, ldo, next, ahead);
  else amx_panel<false, kInt8>(a, lda, b, k4, out, ldo, next, ahead);
}

// Rows of a work item up to which each panel's tile steps fetch the next panel's weights into L2
// (prefetch.hpp), a slice a 32-row block: a decode batch's GEMMs read every weight from memory
// once, and the tiles waited on each panel's first loads (the hardware prefetchers do not run far
// enough ahead of tile loads). The Xeon with AMX, two threads: SmolLM2's layer GEMMs of 60 layers
// (weights beyond the L3), old and new in one binary taking turns, 64 rows 25.6 -> 23.1 ms, 32 rows
// 18.7 -> 16.7, 16 and 1 rows within 2%; `cpuserve bench --dtype bfloat16`, builds taking turns, the
// batch-64 step's GEMMs 17.1-17.2 -> 15.1-15.5 ms (the step 31.2-31.4 -> 29.0-30.0), batch 1 level.
// The bfloat16 kernels fetch ahead on every row count: a prefill's 256-row tiles each read a
// panel from beyond the L2 first (two threads, caches flushed between calls, old and new in one
// binary taking turns, median time ratio of 201 rounds in a noisy minute: 2,048 x 960 x 576 0.94,
// x 576 x 1,536 0.95, gated x 3,072 x 576 0.94-0.97); the W8A8 ones only up to these rows (not
// measured). A gated item counts its blocks across its whole rows, so that each slice is fetched once.
constexpr int64_t kAmxAheadRows = 64;

// The next panel's weights (k4 4-byte units of kNR columns) as amx_gemm's blocks fetch them.
inline Prefetch next_panel(const void* w, int64_t p, int64_t panels, int64_t k4) {
  if (p + 1 >= panels) return {};
  return Prefetch::bytes(static_cast<const char*>(w) + (p + 1) * k4 * kNR * 4, k4 * kNR * 4);
}

// The next gate and up panels (j + 1 and j + 1 + pairs) as block t of `blocks` of a gated kernel's
// item fetches them, where it fetches ahead at all; none after the last pair.
inline std::pair<Prefetch, Prefetch> next_pair(const void* w, int64_t j, int64_t pairs, int64_t k4, int64_t t,
                                               int64_t blocks, bool ahead) {
  if (!ahead || j + 1 >= pairs) return {};
  return {next_panel(w, j, pairs, k4).slice(t, blocks), next_panel(w, j + pairs, 2 * pairs, k4).slice(t, blocks)};
}

// The block after rows [r, r + 32) of panel p in amx_gemm's order (the item's rows m0..m1 for each
// of its panels p..p1), as lines of c (ldc floats a row) for amx_panel to fetch; none past the item.
inline NextOut next_block(void* c, int64_t ldc, int64_t r, int64_t p, int64_t m0, int64_t m1, int64_t p1) {
  if (r + kAmxRows >= m1) r = m0, ++p;
  else r += kAmxRows;
  if (p >= p1) return {};
  return {static_cast<char*>(c) + (r * ldc + p * kNR) * 4, ldc * 4, static_cast<int>(std::min(kAmxRows, m1 - r))};
}

// Rows of a work item: row_tiles' blocks (gemm.hpp) rounded up to 32, run 32 (two row tiles) at a time.
inline int64_t amx_row_block(int64_t m, int64_t panels) {
  const int64_t tiles = row_tiles(m, panels);
  return ((m + tiles - 1) / tiles + kAmxRows - 1) / kAmxRows * kAmxRows;
}

// A rounded to bfloat16 pairs (bf16_pairs_of's bits) one row tile at a time, by the first thread
// of an amx_share to reach the tile (the others wait for it): the rows are rounded just before
// the tiles read them, from this core's L2, where a pass over all of A before the GEMM (its own
// parallel region) wrote them out to the L3 first (2,048 x 576 rows: 2.4 MB).
class LazyPairs {
 public:
  LazyPairs(const float* a, int64_t m, int64_t k, int64_t lda, int64_t k2, int64_t mc)
      : a_(a), m_(m), k_(k), lda_(lda), k2_(k2), mc_(mc), out_(bf16_pairs_buffer(m, k2)),
        state_(new std::atomic<int>[(m + mc - 1) / mc]()) {}

  // A's rounded rows, those of the row tile from m0 ready.
  const bf16x2* rows(int64_t m0) {
    std::atomic<int>& s = state_[m0 / mc_];
    int todo = 0;
    if (s.load(std::memory_order_acquire) != kReady && s.compare_exchange_strong(todo, kBusy)) {
      for (int64_t r = m0, end = std::min(m_, m0 + mc_); r < end; ++r) bf16_pairs_row(a_ + r * lda_, k_, k2_, out_ + r * k2_);
      s.store(kReady, std::memory_order_release);
    }
    while (s.load(std::memory_order_acquire) != kReady) _mm_pause();
    return out_;
  }

 private:
  static constexpr int kBusy = 1, kReady = 2;
  const float* a_;
  int64_t m_, k_, lda_, k2_, mc_;
  bf16x2* out_;
  std::unique_ptr<std::atomic<int>[]> state_;
};

// The row count this thread's tiles are configured for inside an amx_share (0: none yet).
inline int& amx_shape() {
  static thread_local int shape = 0;
  return shape;
}

// run(m0, m1, p0, p1, shape) over row blocks x panel ranges in self-balancing shares (share_tiles).
// A thread keeps its tile configuration from one chunk to the next and releases the tiles after its
// last: ldtilecfg waits for the tile unit to drain, and prefill chunks are a single 256-row panel
// (tiles configured and released per chunk before; two threads, old and new in one binary taking
// turns, median time ratio of 41 rounds: 2,048 x 960 x 576 0.98, x 3,072 x 576 gated 0.94-0.95,
// 512 x 3,072 x 576 gated 0.90-0.94, x 576 x 1,536 0.98-0.99).
template <typename Run>
inline void amx_share(int64_t m, int64_t panels, int64_t work, Run&& run) {
  const int64_t mc = amx_row_block(m, panels), m_tiles = (m + mc - 1) / mc;
  const int64_t chunk = m <= kAmxRows ? 4 : 1;
  share_tiles(
      m_tiles, panels, chunk, work > 32768,
      [&](int64_t mt, int64_t p0, int64_t p1) {
        const int64_t m0 = mt * mc, m1 = std::min(m, m0 + mc);
        if (m0 < m) run(m0, m1, p0, p1, amx_shape());
      },
      [] {
        if (amx_shape() != 0) _tile_release();
        amx_shape() = 0;
      });
}

void amx_gemm(float* c, const float* af, const bf16x2* w, const float* bias, int64_t m, int64_t n, int64_t k,
              int64_t lda, int64_t ldc) {
  const int64_t k2 = packed_pairs(k), panels = (n + kNR - 1) / kNR;
  LazyPairs pairs_of(af, m, k, lda, k2, amx_row_block(m, panels));
  amx_share(m, panels, m * n * k, [&](int64_t m0, int64_t m1, int64_t p0, int64_t p1, int& shape) {
    const bf16x2* a = pairs_of.rows(m0);
    alignas(64) float buf[kAmxRows * kNR];
    const int64_t blocks = (m1 - m0 + kAmxRows - 1) / kAmxRows;
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = m0, t = 0; r < m1; r += kAmxRows, ++t) {
        const int mr = static_cast<int>(std::min(kAmxRows, m1 - r));
        const int64_t col0 = p * kNR, cols = std::min<int64_t>(kNR, n - col0);
        const Prefetch ahead = next_panel(w, p, panels, k2).slice(t, blocks);
        // Without a bias, a whole panel's tiles go straight into C, not through the buffer and a
        // copy (the model's shapes, 512 and 2,048 rows, taking turns in one process: 1.1-1.3x).
        if (bias == nullptr && cols == kNR) {
          amx_rows(mr, a + r * k2, k2, w + p * k2 * kNR, k2, c + r * ldc + col0, shape, ldc,
                   next_block(c, ldc, r, p, m0, m1, std::min(p1, n / kNR)), ahead);
          continue;
        }
        amx_rows(mr, a + r * k2, k2, w + p * k2 * kNR, k2, buf, shape, kNR, {}, ahead);
        for (int i = 0; i < mr; ++i) {
          float* cr = c + (r + i) * ldc + col0;
          const float* br = buf + i * kNR;
          if (bias == nullptr) std::memcpy(cr, br, sizeof(float) * cols);
          else
            for (int64_t j = 0; j < cols; ++j) cr[j] = br[j] + bias[col0 + j];
        }
      }
  });
}

// Rows of gate and up products amx_gemm_silu takes on tiles before the vector code's silu: going
// from tile code to vector code and back costs about 250 cycles each way (attention.hpp), and one
// 32-row block at a time paid that for every 2 x 18 tile steps of a K = 576 gate/up panel pair.
constexpr int64_t kSiluRows = 4 * kAmxRows;

// act[M, F] = silu(A W[0:F]^T) * (A W[F:2F]^T), F a multiple of kNR: gate panel j and up panel
// j + F / kNR for up to kSiluRows rows into two buffers, then silu_mul_row over them; the same bits
// as amx_gemm then silu_and_mul.
void amx_gemm_silu(float* act, const float* af, const bf16x2* w, int64_t m, int64_t f, int64_t k, int64_t lda,
                   int64_t ldo) {
  const int64_t k2 = packed_pairs(k), pairs = f / kNR;
  LazyPairs pairs_of(af, m, k, lda, k2, amx_row_block(m, pairs));
  amx_share(m, pairs, 2 * m * f * k, [&](int64_t m0, int64_t m1, int64_t j0, int64_t j1, int& shape) {
    const bf16x2* a = pairs_of.rows(m0);
    static thread_local LineVector<float> buf(2 * kSiluRows * kNR);
    float* const gate = buf.data();
    float* const up = gate + kSiluRows * kNR;
    const int64_t blocks = (m1 - m0 + kAmxRows - 1) / kAmxRows;
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t r0 = m0; r0 < m1; r0 += kSiluRows) {
        const int64_t r1 = std::min(m1, r0 + kSiluRows);
        for (int64_t r = r0; r < r1; r += kAmxRows) {
          const int mr = static_cast<int>(std::min(kAmxRows, r1 - r));
          const auto [gate_next, up_next] = next_pair(w, j, pairs, k2, (r - m0) / kAmxRows, blocks, true);
          amx_rows(mr, a + r * k2, k2, w + j * k2 * kNR, k2, gate + (r - r0) * kNR, shape, kNR, {}, gate_next);
          amx_rows(mr, a + r * k2, k2, w + (j + pairs) * k2 * kNR, k2, up + (r - r0) * kNR, shape, kNR, {}, up_next);
        }
        for (int64_t i = 0; i < r1 - r0; ++i)
          silu_mul_row(act + (r0 + i) * ldo + j * kNR, gate + i * kNR, up + i * kNR, kNR);
      }
  });
}

#ifdef __AMX_INT8__
static_assert(kI8NR == kNR && kI8KAlign == 4 * kTilePairs, "int8 panels of two tiles, K in whole tiles");

// W8A8 (int8.hpp) on tiles: the activations' int8 codes times the weights' (tdpbssd, no offset),
// then i8gemm's float epilogue. Exact integer sums: the same bits as every other table.
void amx_i8gemm(float* c, const I8Rows& A, const I8Packed& W, const float* bias, int64_t m, int64_t n, int64_t ldc) {
  const int64_t k4 = A.kp / 4, panels = i8_panels(n);
  amx_share(m, panels, m * n * A.kp, [&](int64_t m0, int64_t m1, int64_t p0, int64_t p1, int& shape) {
    alignas(64) int32_t acc[kAmxRows * kNR];
    const int64_t blocks = (m1 - m0 + kAmxRows - 1) / kAmxRows;
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = m0, t = 0; r < m1; r += kAmxRows, ++t) {
        const int mr = static_cast<int>(std::min(kAmxRows, m1 - r));
        const Prefetch ahead = m1 - m0 <= kAmxAheadRows ? next_panel(W.q, p, panels, k4).slice(t, blocks) : Prefetch{};
        amx_rows<true>(mr, A.q + r * A.kp, k4, W.q + p * A.kp * kI8NR, k4, acc, shape, kNR, {}, ahead);
        const int64_t c0 = p * kI8NR, c1 = std::min(n, c0 + kI8NR);
        for (int i = 0; i < mr; ++i)
          i8_out_row(A, r + i, acc + i * kNR, W.sums, W.scales, bias, c0, c1, c + (r + i) * ldc + c0, 0);
      }
  });
}

// i8gemm_silu on tiles: gate panel j and up panel j + pairs, i8gemm's epilogue, then silu_mul_row.
void amx_i8gemm_silu(float* act, const I8Rows& A, const I8Packed& W, int64_t m, int64_t f, int64_t ldo) {
  const int64_t k4 = A.kp / 4, pairs = f / kI8NR;
  amx_share(m, pairs, 2 * m * f * A.kp, [&](int64_t m0, int64_t m1, int64_t j0, int64_t j1, int& shape) {
    alignas(64) int32_t ga[kAmxRows * kNR], ua[kAmxRows * kNR];
    alignas(64) float g[kNR], u[kNR];
    const bool ahead = m1 - m0 <= kAmxAheadRows;
    const int64_t blocks = (m1 - m0 + kAmxRows - 1) / kAmxRows;
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t r = m0, t = 0; r < m1; r += kAmxRows, ++t) {
        const int mr = static_cast<int>(std::min(kAmxRows, m1 - r));
        const auto [gate_next, up_next] = next_pair(W.q, j, pairs, k4, t, blocks, ahead);
        amx_rows<true>(mr, A.q + r * A.kp, k4, W.q + j * A.kp * kI8NR, k4, ga, shape, kNR, {}, gate_next);
        amx_rows<true>(mr, A.q + r * A.kp, k4, W.q + (j + pairs) * A.kp * kI8NR, k4, ua, shape, kNR, {}, up_next);
        const int64_t c0 = j * kI8NR, u0 = (j + pairs) * kI8NR;
        for (int i = 0; i < mr; ++i) {
          i8_out_row(A, r + i, ga + i * kNR, W.sums, W.scales, nullptr, c0, c0 + kI8NR, g, 0);
          i8_out_row(A, r + i, ua + i * kNR, W.sums, W.scales, nullptr, u0, u0 + kI8NR, u, 0);
          silu_mul_row(act + (r + i) * ldo + c0, g, u, kI8NR);
        }
      }
  });
}
#endif  // __AMX_INT8__

}  // namespace
}  // namespace cpuserve
#endif  // __AMX_BF16__
