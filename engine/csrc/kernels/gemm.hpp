// Dense GEMM with packed weights: C[M, N] = A[M, K] @ W^T (+ bias), A and C
// float32, W float32, bfloat16 or float16. Weights are packed once at load time
// into panels of NR = 2 vectors of columns, K-major, so the micro-kernel streams
// one contiguous panel; narrow weights are widened to float32 in registers, so
// bfloat16 halves the memory traffic of decode without a slow bf16 path.
//
// On CPUs with AVX-512 BF16 (the avx512_bf16 table), bfloat16 weights are packed as
// pairs of consecutive k and multiplied by vdpbf16ps with A rounded to bfloat16 (to
// nearest even): twice the float32 FMA rate, and what vLLM's and PyTorch's bf16 paths
// compute. Every other table keeps float32 activations for bfloat16 weights.
//
// Batch invariance: each C element is a single fused multiply-add chain over k
// (over k pairs, in the bf16 pair path) in increasing order (continued across K
// blocks through C), whatever the micro-kernel height, the M tiling or the thread count.
#pragma once
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>
#include <omp.h>
#include <unistd.h>
#include "../vec/vec.hpp"
#include "line_vector.hpp"
#include "prefetch.hpp"
#include "shares.hpp"

namespace cpuserve {
namespace {

constexpr int kNR = 2 * VecF::N;
constexpr int kMR = 6;
// Rows of a GEMM few enough for one micro-kernel pass over its weights (decode): 8 with 32 vector
// registers (16 accumulators, two weight vectors and the broadcast), kMR with AVX2's 16. Against
// a 6-row tile and a 1- or 2-row tile reading each weight chunk again from L2 (the default model's
// 121 GEMMs, weights from memory, AMD EPYC Zen 5, the two taking turns in one process, medians of
// 40): float32 7 / 8 rows 17.6 / 18.0 -> 15.0 / 16.2 ms, bfloat16 9.1 / 9.4 -> 8.7 / 8.7 ms;
// cached 1,536 x 576 weights, 8 rows 49 -> 38 us; 1-6 and 12-16 rows unchanged.
constexpr int kPassRows = VecF::kRegs >= 32 ? 8 : kMR;
constexpr int64_t kKC = 384;   // K block where a panel's whole K is too big for the L2 (k_block)
constexpr int64_t kMC = 72;    // rows of A per work item: the least, see row_tiles

// This CPU's L2 size in bytes, 0 or less where the system does not say (qemu-user); read once.
inline long l2_bytes() {
  static const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return l2;
}

// How many row tiles a GEMM of m rows over `panels` weight panels is cut into. One tile's A block
// (its rows x a K block) stays in L2 next to the weight chunks streaming through: up to 40% of the
// L2, at most 264 rows (72 where the L2 size is unknown), so that each weight chunk brought from
// memory serves as many rows as possible (72 -> 264 rows on a 1 MiB L2, weights from memory:
// 128..1,024 rows of float32 3-7% faster, bfloat16 2-3%). More tiles where the panels alone
// would leave threads without work, while tiles keep kMC rows. (Sized for a kKC block of A; since
// whole-K blocks (k_block) a 264-row tile's A outgrows the L2 on the widest layers, and 512 rows
// were still 7% faster that way.)
inline int64_t row_tiles(int64_t m, int64_t panels) {
  static const int64_t most = [] {
    const long l2 = l2_bytes();
    const int64_t rows = l2 > 0 ? static_cast<int64_t>(0.4 * static_cast<double>(l2)) / (kKC * 4) / kMR * kMR : 0;
    return std::clamp<int64_t>(rows, kMC, 264);
  }();
  const int64_t fewest = (m + most - 1) / most, most_tiles = (m + kMC - 1) / kMC;
  const int64_t for_threads = (4 * omp_get_max_threads() + panels - 1) / panels;
  return std::max(fewest, std::min(most_tiles, for_threads));
}

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

#ifdef __AVX512BF16__
constexpr bool kBf16Pairs = true;
#else
constexpr bool kBf16Pairs = false;
#endif

// The rows of a batch GEMM's register tile over weights of type T: kMR, or 12 for bfloat16 pairs
// on vdpbf16ps, whose 6-cycle latency wants more chains in flight than 6 rows x 2 vectors: on AMD
// EPYC Zen 5 (two vdpbf16ps a cycle) 12 independent chains reach 91% of its rate, 16 and more
// 100%, against 12 for float32's 4-cycle FMA. 12 x 2 vectors is 24 accumulators, two weight
// vectors and a broadcast: 27 of the 32 registers, 14 loads per 24 dot products where 6 rows took 8
// per 12. Float32 weights on AVX-512 take 12 rows too, and so do the narrow weights widened in
// registers (float16, and bf16p: AVX-512 without BF16): each row tile streams its panel's chunk
// (the whole K: 72 KB of float32 at K = 576, past the L1) from the L2, and 12 rows stream it half
// as often as 6. The Xeon with AMX (float32 runs on its FMA units), two threads, old and new in one
// binary taking turns (medians of 21-31 rounds, time new / old, the same bits): float32 128 x 960
// x 576 0.87x (one thread 0.88x), 128 x 576 x 576 0.88x, 128 x 576 x 1,536 0.88x, 2,048 x 960 x
// 576 0.92x, 2,048 x 576 x 1,536 0.90x, 64 x 1,536 x 576 0.91x, 20-32 rows x 960 x 576
// 0.79-0.80x, 128 x 3,072 x 576 with 40 weight copies in turn (280 MB: the L3 and memory) 0.87x;
// 16 rows (a pass, kPassRows) level; float16 0.92x / 0.93x / 0.95x (128 x 960 x 576, 2,048 x 576 x
// 1,536, 64 x 1,536 x 576), 32 rows 0.92x. Built as the avx512_vnni table on the same CPU: float32
// 0.87x / 0.94x / 0.89x, bf16p 0.92x / 0.90x / 0.94x, 32 rows 0.89x. 14 float32 rows were no
// better than 12 (0.95-1.00x). The GGUF blocks' GEMM (quant.hpp), whose dequantized chunk sits in
// L1, keeps kMR: 12 rows took 1.03-1.10x its time. Other tables keep kMR (AVX2 has 16 registers;
// NEON and VXE were not measured).
#ifdef __AVX512F__
constexpr bool kWideFloatTiles = true;
#else
constexpr bool kWideFloatTiles = false;
#endif
template <typename T>
constexpr bool kWideTileWeights =
    std::is_same_v<T, float> || std::is_same_v<T, bf16p> || std::is_same_v<T, f16>;
template <typename T>
constexpr int kTileRows =
    (std::is_same_v<T, bf16x2> && kBf16Pairs) || (kWideTileWeights<T> && kWideFloatTiles) ? 12 : kMR;
template <typename T>
constexpr int kTileMax = std::max(kPassRows, kTileRows<T>);

// The rows of each row tile over a weight chunk in a batch GEMM of `rows` rows (more than
// kPassRows): two even tiles where they fit a pass each, else kMR, or tiles of at most
// kTileRows<T> as even as they go (64 rows: 11 x 5 + 9, not 12 x 5 + 4). 16 rows (a 16-stream decode
// step) as 8 + 8 instead of 6 + 6 + 4 read each chunk from L2 twice instead of three times, and
// drop the 4-row tile's half-rate FMAs per load. The default model's 120 layer GEMMs, weights
// from memory, AMD EPYC Zen 4, the two taking turns (medians of 7 each): float32 16 rows
// 25.0-29.5 -> 22.6-24.8 ms (4 runs of 4), bfloat16 15.6-19.4 -> 14.8-16.7 (3 of 3); 14 rows
// faster in 2 runs of 3. 8-row tiles for 64 rows too changed nothing measurable: kMR stays.
// One pass of 16 rows over each panel a vector of columns at a time (16 accumulators, A copied
// k-major so that every FMA broadcasts from one line) was tried against 8 + 8 on the same VM model:
// cached weights level (2,048 x 576: 185-188 GFLOP/s both), from memory slower (1,536 x 576
// 1.1-1.2x the time), the 16-row decode step's GEMMs in `cpuserve bench` 1.12x float32 and 1.17x
// bfloat16 (3 rounds taking turns): the chunk's second pass from L2 is not what the step waits on.
template <typename T>
inline int64_t tile_rows(int64_t rows) {
  if (kPassRows > kMR && rows <= 2 * kPassRows) return (rows + 1) / 2;
  if constexpr (kTileRows<T> == kMR) return kMR;
  const int64_t tiles = (rows + kTileRows<T> - 1) / kTileRows<T>;
  return (rows + tiles - 1) / tiles;
}

// Whether a bfloat16 weight of K columns is packed as (k, k + 1) pairs that are widened in registers
// (bf16p, AVX2): an even K. A 32-byte load then gives two vectors of 8 columns by one shift and one
// mask, where 8 bfloat16 at a time took a zero-extension and a shift each: half the vector work of
// widening, which bounded AVX2's bfloat16 GEMMs (from L3 they ran slower than float32's with twice
// the bytes). The default model's 120 layer GEMMs, AMD EPYC Zen 3, two builds taking turns,
// medians: 1 row from L3 8.25 -> 6.52 ms (with the decode micro-kernel's order below), 16 rows
// 38.7 -> 33.8, 64 rows 146 -> 132; from memory 1 row unchanged (17.6 / 17.1, bandwidth-bound in
// minutes of 15-22 GB/s). AVX-512 without BF16 (the avx512 and avx512_vnni tables, e.g. Intel Xeons
// before Cooper Lake) the same way, 64 bytes giving two vectors of 16: under CPUSERVE_ISA=avx512 on
// the AMD EPYC Zen 4 VM, weights from memory, the builds taking turns by process, 64 rows 73.9-78.4
// -> 64.2-68.3 ms, 512 rows 599-616 -> 516-534, 16 rows 18.5 -> 17.1, 6 rows 8.4-8.8 -> 7.9-8.1, 1
// row level. The same chains: the same bits.
constexpr bool widened_pairs(int64_t k) { return WidensPairs<VecF>::value && !kBf16Pairs && k % 2 == 0; }

// gemm(a as float pairs, w as bf16p, k / 2, the pairs' row stride) where this ISA widens pairs and K
// is even; false (nothing run) otherwise. A template, so that other ISAs never instantiate the path.
template <typename Gemm, typename V = VecF>
inline bool run_widened_pairs(const float* a, int64_t m, int64_t k, int64_t lda, const void* w, Gemm&& gemm);

// The multiple of K that a bfloat16 weight packed as pairs is padded to with zeros: whole AMX
// tiles of 16 pairs on the amx table (amx.hpp), else an even K (KernelTable::bf16_k_align).
#ifdef __AMX_BF16__
constexpr int kBf16KAlign = 32;
#else
constexpr int kBf16KAlign = 2;
#endif
constexpr int64_t packed_pairs(int64_t k) { return (k + kBf16KAlign - 1) / kBf16KAlign * kBf16KAlign / 2; }

// W [N, K] bf16 -> panels of (k, k+1) pairs [ceil(N/nr)][packed_pairs(K)][nr], zero padded.
void pack_bf16_pairs(bf16x2* dst, const bf16* src, int64_t n, int64_t k) {
  const int64_t panels = (n + kNR - 1) / kNR, k2 = packed_pairs(k);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t q = 0; q < k2; ++q)
      for (int j = 0; j < kNR; ++j) {
        const int64_t col = p * kNR + j;
        const uint32_t lo = col < n && 2 * q < k ? src[col * k + 2 * q].bits : 0;
        const uint32_t hi = col < n && 2 * q + 1 < k ? src[col * k + 2 * q + 1].bits : 0;
        dst[(p * k2 + q) * kNR + j] = bf16x2{lo | (hi << 16)};
      }
}

void pack_weight_impl(void* dst, const void* src, DType dt, int64_t n, int64_t k) {
  if (dt == DType::BF16 && (kBf16Pairs || widened_pairs(k)))
    return pack_bf16_pairs(static_cast<bf16x2*>(dst), static_cast<const bf16*>(src), n, k);
  switch (dt) {
    case DType::F32: return pack_weight_t(static_cast<float*>(dst), static_cast<const float*>(src), n, k);
    case DType::BF16: return pack_weight_t(static_cast<bf16*>(dst), static_cast<const bf16*>(src), n, k);
    case DType::F16: return pack_weight_t(static_cast<f16*>(dst), static_cast<const f16*>(src), n, k);
  }
}

// Whether a batch micro-kernel asks for its tile of C's lines before its k loop (AVX-512: 12 or 6
// rows of two 64-byte vectors). C is a batch GEMM's output, mostly out of the caches since a layer
// before; the tile's stores at the end of the loop missed, filled the store queue and held up the
// next tile behind them. Fetched at the start, the lines come in while the tile computes. AMD EPYC
// Zen 5, two threads, old and new in one binary taking turns (medians of 7): bfloat16 2,048 x
// 1,536 x 576 and 2,048 x 960 x 576 0.87x the time, 512 x 1,536 x 576 0.88-0.91x, float32 2,048 x
// 1,536 x 576 0.87x, 2,048 x 576 x 1,536 0.96x; 64 rows and the gated GEMM (tiles into a hot
// scratch) level. AVX2's tiles of 6 rows x 32 bytes: level (0.99-1.03x), so left as they were.
// As a loop written here in the kernel: the same loop in an always-inline helper left the
// accumulators on the stack through the k loop (GCC 12; 2.5x the time).
#ifdef __AVX512F__
constexpr bool kFetchTileOfC = true;
#else
constexpr bool kFetchTileOfC = false;
#endif

// How many k steps ahead of its loads decode (MR <= 2, NP > 1) asks for each panel's weight lines
// where they are marked non-temporal (DecodeFetch::kNonTemporal, 128 bytes a panel a step): one step
// (kL2Ahead: kL2AheadSteps, prefetch.hpp). 16 steps (2 KB a panel) were tried on
// the AMD EPYC Zen 5 VM, where on 4 KB pages they took 0.78-0.95x the time of the model's GEMVs
// (the hardware prefetchers stop at each page's end) but on the engine's huge-paged weights
// (platform/pages.py) 0.96-1.00x, level in its batch-1 bench. On AMD EPYC Zen 4 they cost: the
// engine's `cpuserve bench` batch-1 decode, one build of each taking turns by process, 11 rounds,
// every round slower than one step: float32 1.13-1.16x the time (medians of two sittings),
// bfloat16 1.12-1.24x; 4 steps 1.05x / 1.09x; none at all 1.24x float32, level bfloat16.
constexpr int64_t kDecodeAhead = 1;

// Whether a micro-kernel of MR rows over weights of type T paces the fetch of the next weight chunk
// (`pf`, kernels/prefetch.hpp) through its k loop: all but the bfloat16 pair tiles of more than
// kPassRows rows (a batch of more than 16 rows on vdpbf16ps), which run from the L2 at their
// arithmetic's rate and gained nothing from the fetch, while its bookkeeping in the k loop, beside
// 9-12 row pointers, left the loop short of general registers (row pointers reloaded from the stack
// or moved back from vector registers at every step). The default model's four layer GEMMs (the
// SiLU-gated gate/up among them), AMD EPYC Zen 4, two threads, the two builds in one process
// taking turns (medians of 9-15 rounds, time new / old): cached weights 1,024 and 256 rows 0.94x,
// 64 rows 0.96x; 30 layers' weights from memory 64 and 32 rows 0.97x; 16 rows (8-row tiles, which
// keep the fetch: without it they took 1.06x) and float32 level. The same chains: the same bits.
template <typename T>
constexpr bool paces_prefetch(int64_t rows) {
  return !(std::is_same_v<T, bf16x2> && kBf16Pairs && rows > kPassRows);
}

// MR x (NP panels of NR) micro-kernel over one K block, `pf` (kernels/prefetch.hpp) fetched
// evenly over its k loop (64 rows of float32 on weights from memory: 380 -> 430 GFLOP/s,
// against 450-475 on cached ones). `first` starts the chain
// at zero, otherwise it continues from C. `cols` < NR only in the last (padded)
// panel, which is always handled with NP = 1. Small MR use several panels at
// once so that decode (M = 1, 2) keeps 8 independent FMA chains in flight
// instead of waiting on the latency of 2; each output element is still the
// same single chain, so results do not depend on MR or NP.
// Never inlined: inlined into the gated GEMM's work-item lambda (gated_gemm.hpp), whose own
// variables stay live across it, the k loop ran out of general registers and reloaded its row
// pointers from the stack at every step (five loads and two register moves per 12 FMAs), and
// float32 SiLU-gated GEMMs ran at 82% of the plain GEMM's rate. Out of line, the loop holds its
// pointers in registers in every caller. AMD EPYC Zen 4 (AVX-512), alternating processes, medians:
// the model's gate/up shape 64 rows 189 -> 224 GFLOP/s, 2,048 rows 192 -> 220; down 64 rows 214
// -> 229; the model's 30 layers' GEMMs from memory, 64 rows 72.6 -> 67.4 ms; 1-16 rows, bfloat16
// and AVX2 unchanged (the same code otherwise: the same bits).
template <int MR, int NP, DecodeFetch F = DecodeFetch::kNonTemporal, typename T, typename TA = AOf<T>>
[[gnu::noinline]] void micro_kernel(const TA* a, int64_t lda, const T* b, int64_t panel_stride, int64_t kc,
                         float* c, int64_t ldc, bool first, int cols, Prefetch pf = {}) {
  VecF acc[MR][NP][2];
  alignas(64) float tmp[kNR];
  if constexpr (NP == 1 && kFetchTileOfC) {  // C's lines asked for before the k loop (see above)
    for (int r = 0; r < MR; ++r) {
      __builtin_prefetch(c + r * ldc, 1, 3);
      __builtin_prefetch(c + r * ldc + VecF::N, 1, 3);
      __builtin_prefetch(c + r * ldc + kNR - 1, 1, 3);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) {
      float* cp = c + r * ldc + q * kNR;
      if (first) {
        acc[r][q][0] = VecF::zero();
        acc[r][q][1] = VecF::zero();
      } else if (cols == kNR) {
        acc[r][q][0] = VecF::load(cp);
        acc[r][q][1] = VecF::load(cp + VecF::N);
      } else {
        std::memset(tmp, 0, sizeof(tmp));
        std::memcpy(tmp, cp, sizeof(float) * cols);
        acc[r][q][0] = VecF::load(tmp);
        acc[r][q][1] = VecF::load(tmp + VecF::N);
      }
    }
  int64_t pf_line = pf.first, pf_acc = 0;
  for (int64_t kk = 0; kk < kc; ++kk) {
    if constexpr (NP > 1) {  // decode reads each weight once: its lines asked for as DecodeFetch F says
      constexpr int64_t ahead = F == DecodeFetch::kL2Ahead ? kL2AheadSteps : kDecodeAhead;
      if (kk + ahead < kc)
        for (int q = 0; q < NP; ++q)
          for (int64_t o = 0; o < static_cast<int64_t>(kNR * sizeof(T)); o += 64) {
            const char* line = reinterpret_cast<const char*>(b + q * panel_stride + (kk + ahead) * kNR) + o;
            if constexpr (F == DecodeFetch::kL2Ahead) prefetch_l2(line);
            else prefetch_nta(line);
          }
    }
    for (int h = 0; h < kSubSteps<T>; ++h) {  // bf16p: k, then k + 1 of the pairs at kk
      if constexpr (NP > 1) {
        // decode (MR <= 2): each panel's two weight vectors used as soon as they are loaded, so
        // that widened ones do not all wait in registers (8 of them spilled an accumulator)
        VecF av[MR];
        for (int r = 0; r < MR; ++r) av[r] = VecF::set1(act_at(a[r * lda + kk], h));
        for (int q = 0; q < NP; ++q) {
          const VecF b0 = weight_at(b + q * panel_stride + kk * kNR, h);
          const VecF b1 = weight_at(b + q * panel_stride + kk * kNR + VecF::N, h);
          for (int r = 0; r < MR; ++r) {
            acc[r][q][0] = Madd<T>::apply(av[r], b0, acc[r][q][0]);
            acc[r][q][1] = Madd<T>::apply(av[r], b1, acc[r][q][1]);
          }
        }
      } else {
        const VecF b0 = weight_at(b + kk * kNR, h), b1 = weight_at(b + kk * kNR + VecF::N, h);
        for (int r = 0; r < MR; ++r) {
          const VecF av = VecF::set1(act_at(a[r * lda + kk], h));
          acc[r][0][0] = Madd<T>::apply(av, b0, acc[r][0][0]);
          acc[r][0][1] = Madd<T>::apply(av, b1, acc[r][0][1]);
        }
      }
    }
    if constexpr (paces_prefetch<T>(MR))
      for (pf_acc += pf.count; pf_acc >= kc; pf_acc -= kc) pf.line(pf_line++);
  }
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) {
      float* cp = c + r * ldc + q * kNR;
      if (cols == kNR) {
        acc[r][q][0].store(cp);
        acc[r][q][1].store(cp + VecF::N);
      } else {
        acc[r][q][0].store(tmp);
        acc[r][q][1].store(tmp + VecF::N);
        std::memcpy(cp, tmp, sizeof(float) * cols);
      }
    }
}

// micro_kernel<mr, 1> for a run-time mr <= R.
template <int R, typename T, typename TA>
inline void micro_tile(int mr, const TA* a, int64_t lda, const T* b, int64_t panel_stride, int64_t kc, float* c,
                       int64_t ldc, bool first, int cols, Prefetch pf) {
  if constexpr (R > 1)
    if (mr < R) return micro_tile<R - 1>(mr, a, lda, b, panel_stride, kc, c, ldc, first, cols, pf);
  micro_kernel<R, 1>(a, lda, b, panel_stride, kc, c, ldc, first, cols, pf);
}

// The fewest rows of a decode pass (micro_rows) that fetch the next panel's chunk into L2 while
// they multiply this one's: more than kMR (8 rows from memory: 20.2 -> 18.0 ms float32, 11.0 -> 8.8
// bfloat16), and over bfloat16 pairs widened in registers 4 on AVX2, 5 on AVX-512: the widening
// holds each weight line long enough for the prefetchers to fall behind. The default model's 120
// layer GEMMs, weights from memory (AMD EPYC Zen 4, the builds taking turns by process, 3 rounds of
// 7): under CPUSERVE_ISA=avx2 4 rows 8.0-8.9 -> 6.8-8.5 ms, 5 rows 9.9-10.1 -> 7.6-8.5, 6 rows
// 12.4-12.7 -> 8.4-9.2, from the L3 (one layer's) level, `cpuserve bench` 4 / 5 / 6 sequences
// 321-344 -> 369-391, 309 -> 357, 322-326 -> 466-472 tok/s; under CPUSERVE_ISA=avx512 5 and 6 rows
// 0.92-0.98x the time, 4 rows level or slower. Fewer rows, and these row counts elsewhere, are
// left to the hardware: AVX2's bfloat16 3 rows level or slower with the fetch, its float32 5 and 6
// rows 1.10-1.30x the time, AVX-512 BF16's pairs 1.03-1.16x; 3 rows of float32 cost 20% on cached
// weights and gained nothing from memory.
template <typename T>
constexpr int kPassFetchRows = std::is_same_v<T, bf16p> ? (VecF::kRegs < 32 ? 4 : 5) : kMR + 1;

// Runs rows [r, r + mr) against panels [p, p1): as many panels at once as the
// register budget allows for this mr. Returns nothing; covers the whole range.
template <typename T, typename TA = AOf<T>>
inline void micro_rows(int mr, const TA* a, int64_t lda, const T* w, int64_t k, int64_t k0, int64_t kc,
                       float* c, int64_t ldc, int64_t p, int64_t p1, int64_t n, bool first, Prefetch pf = {}) {
  const int64_t ps = k * kNR;  // distance between panels
  const bool l2_ahead = mr <= 2 && decode_fetch() == DecodeFetch::kL2Ahead;
  auto full = [&](int64_t q) { return (q + 1) * kNR <= n; };
  while (p < p1) {
    const T* bp = w + p * ps + k0 * kNR;
    float* cp = c + p * kNR;
    const int cols = static_cast<int>(std::min<int64_t>(kNR, n - p * kNR));
    if (mr == 1 && p + 4 <= p1 && full(p + 3)) {
      if (l2_ahead) micro_kernel<1, 4, DecodeFetch::kL2Ahead>(a, lda, bp, ps, kc, cp, ldc, first, kNR);
      else micro_kernel<1, 4>(a, lda, bp, ps, kc, cp, ldc, first, kNR);
      p += 4;
      continue;
    }
    if (mr == 2 && p + 2 <= p1 && full(p + 1)) {
      if (l2_ahead) micro_kernel<2, 2, DecodeFetch::kL2Ahead>(a, lda, bp, ps, kc, cp, ldc, first, kNR);
      else micro_kernel<2, 2>(a, lda, bp, ps, kc, cp, ldc, first, kNR);
      p += 2;
      continue;
    }
    // A pass of kPassFetchRows rows or more spends long enough on each weight line for the
    // hardware prefetchers to fall behind: the next panel's chunk is fetched into L2 along the way.
    const int64_t chunk = kc * kNR * static_cast<int64_t>(sizeof(T));
    const Prefetch next = mr >= kPassFetchRows<T> && p + 1 < p1 ? Prefetch::bytes(bp + ps, chunk) : pf;
    micro_tile<kTileMax<T>>(mr, a, lda, bp, ps, kc, cp, ldc, first, cols, next);
    ++p;
  }
}

// The weight chunk multiplied after panel p's chunk at k0 in a work item over panels [p0, p1):
// the next panel's, the first panel's at the next K block, or the next work item's first.
template <typename T>
inline Prefetch next_chunk(const T* w, int64_t k, int64_t k0, int64_t kc_max, int64_t p, int64_t p0,
                           int64_t p1, int64_t panels) {
  int64_t q = p + 1, q0 = k0;
  if (q == p1) {
    q = p0;
    q0 = k0 + kc_max;
    if (q0 >= k) q = p1 % panels, q0 = 0;
  }
  const int64_t kc = std::min(kc_max, k - q0);
  return Prefetch::bytes(w + q * k * kNR + q0 * kNR, static_cast<int64_t>(kc * kNR * sizeof(T)));
}

// The K block of a batch GEMM: the whole K where an NR-wide panel's chunk of it fits a quarter
// of the L2 (up to 2,048 float32 or bfloat16 pairs on a 1 MiB L2: every layer of SmolLM2,
// k <= 1,536), else kKC (a 24-48 KB chunk, the block size before; also where the L2 size is
// unknown). K blocks cut each panel's stream in two or four for no gain: against kKC blocks and
// groups of up to 8 panels, weights from memory, the model's 30 layers (AMD EPYC Zen 5, 1 MiB
// L2), float32 16 rows 12.6 -> 10.8-11.3 ms (48 GB/s minute), 64 rows 33.0 -> 30.5-31.0 and 512
// rows 250 -> 232 (80 GB/s), 1,024 rows 464 -> 446; bfloat16 16 rows 6.3 -> 5.9, 64 rows 20.2-21.6
// -> 19.0, 512 rows 139 -> 128-130. The chain over k runs in the same order: the same bits.
template <typename T>
inline int64_t k_block(int64_t k) {
  const long l2 = l2_bytes();
  const int64_t fallback = std::is_same_v<T, bf16x2> || std::is_same_v<T, bf16p> ? kKC / 2 : kKC;
  if (l2 > 0 && k * kNR * static_cast<int64_t>(sizeof(T)) <= l2 / 4) return k;
  return std::min(k, fallback);
}

// Panels a thread takes at a time out of `items` (row tiles x panels): a decode pass's 4-panel group
// (micro_rows); one panel of a batch, whose every row tile reads it whole, unless K is blocked:
// then an eighth of a share, so that each block of A in L2 still serves several panels.
inline int64_t tile_chunk(bool pass, bool whole_k, int64_t items) {
  if (pass) return 4;
  if (whole_k) return 1;
  const int64_t threads = omp_get_max_threads();
  return std::max<int64_t>(1, (items + 8 * threads - 1) / (8 * threads));
}

// k counts elements of T (k pairs for bf16x2 and bf16p).
template <typename T, typename TA = AOf<T>>
void gemm_t(float* c, const TA* a, const T* w, const float* bias, int64_t m, int64_t n, int64_t k,
            int64_t lda, int64_t ldc) {
  const int64_t panels = (n + kNR - 1) / kNR;
  // Row tiles as even as possible and multiples of kMR, so that e.g. M = 64 is one tile
  // (each weight panel read once), not 48 + 16.
  const int64_t m_tiles = row_tiles(m, panels);
  const int64_t mc = ((m + m_tiles - 1) / m_tiles + kMR - 1) / kMR * kMR;
  // Each panel's whole K at once where it fits (k_block); decode always takes the whole K: its A
  // is one or two rows.
  const int64_t kc_max = m <= 2 ? k : k_block<T>(k);
  const int64_t chunk = tile_chunk(mc <= kPassRows, kc_max == k, m_tiles * panels);
  share_tiles(m_tiles, panels, chunk, m * n * k > 32768, [&](int64_t mt, int64_t p0, int64_t p1) {
    const int64_t m0 = mt * mc, m1 = std::min(m, m0 + mc);
    if (m0 >= m) return;
    for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
      const int64_t kc = std::min(kc_max, k - k0);
      if (m1 - m0 <= kPassRows) {  // decode: one pass over the rows, wide over panels
        micro_rows(static_cast<int>(m1 - m0), a + m0 * lda + k0, lda, w, k, k0, kc, c + m0 * ldc, ldc, p0, p1, n,
                   k0 == 0);
        continue;
      }
      const int64_t tr = tile_rows<T>(m1 - m0), tiles = (m1 - m0 + tr - 1) / tr;
      for (int64_t p = p0; p < p1; ++p) {  // one panel chunk reused by every row tile
        // one row tile streams its chunk once: the hardware prefetchers keep up with that alone
        const bool fetch = tiles > 1 && paces_prefetch<T>(tr);
        const Prefetch next = fetch ? next_chunk(w, k, k0, kc_max, p, p0, p1, panels) : Prefetch{};
        for (int64_t r = m0, t = 0; r < m1; r += tr, ++t) {
          const int mr = static_cast<int>(std::min<int64_t>(tr, m1 - r));
          micro_rows(mr, a + r * lda + k0, lda, w, k, k0, kc, c + r * ldc, ldc, p, p + 1, n, k0 == 0,
                     next.slice(t, tiles));
        }
      }
    }
    if (bias != nullptr)
      for (int64_t r = m0; r < m1; ++r)
        for (int64_t col = p0 * kNR; col < std::min(n, p1 * kNR); ++col) c[r * ldc + col] += bias[col];
  });
}

#ifdef __AVX512BF16__
// A rounded to bfloat16 pairs (nearest even, as from_float<bf16>), one row after another: a row's
// bfloat16 values in order are its pairs (k, k + 1), k2 pairs a row (an odd K, or AMX's whole
// tiles, padded with zeros). Whole vectors are rounded by vcvtneps2bf16, which flushes denormals
// where from_float keeps them: vdpbf16ps and tdpbf16ps read a denormal as zero either way, so the
// products are the same.
inline void bf16_pairs_row(const float* ar, int64_t k, int64_t k2, bf16x2* out) {
  bf16* o = reinterpret_cast<bf16*>(out);
  int64_t e = 0;
  for (; e + VecF::N <= k; e += VecF::N) VecF::load(ar + e).store_bf16(o + e);
  for (; e < k; ++e) o[e] = from_float<bf16>(ar[e]);
  for (; e < 2 * k2; ++e) o[e] = bf16{0};
}

// This thread's buffer for m rows of k2 pairs.
inline bf16x2* bf16_pairs_buffer(int64_t m, int64_t k2) {
  thread_local LineVector<bf16x2> buf;
  buf.resize(static_cast<size_t>(m * k2));
  return buf.data();
}

inline const bf16x2* bf16_pairs_of(const float* a, int64_t m, int64_t k, int64_t lda, int64_t k2) {
  bf16x2* out = bf16_pairs_buffer(m, k2);
#pragma omp parallel for schedule(static) if (m * k > 65536)
  for (int64_t r = 0; r < m; ++r) bf16_pairs_row(a + r * lda, k, k2, out + r * k2);
  return out;
}
#endif

// A as rows of float pairs for the bf16p path (an even K): A itself where its row stride is even,
// else its rows copied with an even stride.
struct float2_rows { const f32x2* p; int64_t ld; };
inline float2_rows float_pairs_of(const float* a, int64_t m, int64_t k, int64_t lda) {
  if (lda % 2 == 0) return {reinterpret_cast<const f32x2*>(a), lda / 2};
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(m * k));
  for (int64_t r = 0; r < m; ++r) std::memcpy(buf.data() + r * k, a + r * lda, sizeof(float) * k);
  return {reinterpret_cast<const f32x2*>(buf.data()), k / 2};
}

template <typename Gemm, typename V>
inline bool run_widened_pairs(const float* a, int64_t m, int64_t k, int64_t lda, const void* w, Gemm&& gemm) {
  if constexpr (WidensPairs<V>::value && !kBf16Pairs) {
    if (!widened_pairs(k)) return false;
    const float2_rows a2 = float_pairs_of(a, m, k, lda);
    gemm(a2.p, k / 2, a2.ld, static_cast<const bf16p*>(w));
    return true;
  } else {
    return false;
  }
}

#ifdef __AMX_BF16__
// amx.hpp: every bfloat16 GEMM of the amx table
void amx_gemm(float* c, const float* a, const bf16x2* w, const float* bias, int64_t m, int64_t n, int64_t k,
              int64_t lda, int64_t ldc);
#endif

void gemm_impl(float* c, const float* a, const void* w, DType dt, const float* bias, int64_t m,
               int64_t n, int64_t k, int64_t lda, int64_t ldc) {
#ifdef __AMX_BF16__
  if (dt == DType::BF16) return amx_gemm(c, a, static_cast<const bf16x2*>(w), bias, m, n, k, lda, ldc);
#elif defined(__AVX512BF16__)
  if (dt == DType::BF16) {
    const int64_t k2 = (k + 1) / 2;
    return gemm_t(c, bf16_pairs_of(a, m, k, lda, k2), static_cast<const bf16x2*>(w), bias, m, n, k2, k2, ldc);
  }
#endif
  if (dt == DType::BF16 && run_widened_pairs(a, m, k, lda, w, [&](auto a2, int64_t k2, int64_t lda2, auto w2) {
        gemm_t(c, a2, w2, bias, m, n, k2, lda2, ldc);
      }))
    return;
  switch (dt) {
    case DType::F32: return gemm_t(c, a, static_cast<const float*>(w), bias, m, n, k, lda, ldc);
    case DType::BF16: return gemm_t(c, a, static_cast<const bf16*>(w), bias, m, n, k, lda, ldc);
    case DType::F16: return gemm_t(c, a, static_cast<const f16*>(w), bias, m, n, k, lda, ldc);
  }
}

}  // namespace
}  // namespace cpuserve
