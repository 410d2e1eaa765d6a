// The kernel interface: one table of function pointers per ISA. isa_unit.cpp
// fills it for the ISA it is compiled for; dispatch.cpp picks the best table
// the running CPU supports. Tensors travel as raw pointers plus shapes and
// strides (in elements), so no torch headers are needed.
#pragma once
#include <cstdint>
#include "dtype.hpp"

namespace cpuserve {

struct KernelTable {
  const char* isa;
  int vec_width;  // floats per vector register
  int gemm_nr;    // panel width of packed weights (columns of W^T per panel)
  // bfloat16 weights run as pair dot products on A rounded to bfloat16 (AVX-512 BF16); a
  // packed bf16 weight then holds ceil(K/2) pairs a column (K rounded up to bf16_k_align)
  bool bf16_dot;
  // K of a bfloat16 weight rounded up to this multiple in its packed panels (zeros): 32 on AMX
  // (whole tiles of 16 pairs), else 2; pack_weight's buffer holds panels x gemm_nr x that K
  int bf16_k_align;

  // out[r, :] = x[r, :] / rms(x[r, :]) * w           (out may alias x)
  void (*rms_norm)(float* out, const float* x, const float* w, int64_t rows, int64_t dim,
                   int64_t x_stride, int64_t out_stride, float eps);
  // residual += x; x = rms_norm(residual) * w       (both in place)
  void (*fused_add_rms_norm)(float* x, float* residual, const float* w, int64_t rows, int64_t dim,
                             int64_t x_stride, int64_t res_stride, float eps);
  // In-place rotary embedding of q [T, Hq, D] and k [T, Hk, D] (token strides given);
  // cos_sin [max_pos, rot_dim]: rot_dim/2 cosines then rot_dim/2 sines.
  void (*rotary)(float* q, float* k, const int64_t* positions, const float* cos_sin, int64_t tokens,
                 int64_t num_q_heads, int64_t num_k_heads, int64_t head_dim, int64_t rot_dim,
                 int64_t q_stride, int64_t k_stride, bool neox);
  // out[t, :d] = act(x[t, :d]) * x[t, d:2d]
  void (*silu_and_mul)(float* out, const float* x, int64_t tokens, int64_t d, int64_t x_stride,
                       int64_t out_stride);
  void (*gelu_and_mul)(float* out, const float* x, int64_t tokens, int64_t d, int64_t x_stride,
                       int64_t out_stride, bool tanh_approx);
  // k_cache [num_blocks, Hk, D, block_size] (keys transposed in each block), v_cache
  // [num_blocks, Hk, block_size, D], of cache_dtype; slot -1 is skipped.
  // The cache holds key / k_scale and value / v_scale (float8's per-tensor scales; 1 otherwise).
  void (*reshape_and_cache)(const float* key, const float* value, void* k_cache, void* v_cache,
                            DType cache_dtype, const int64_t* slot_mapping, int64_t tokens,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            int64_t key_stride, int64_t value_stride, float k_scale, float v_scale);
  // Paged attention for a batch of sequences, each contributing q_len = qsl[s+1]-qsl[s]
  // query tokens that are the last q_len positions of its seq_lens[s] context. Query
  // head i uses kv head (i + q_head_offset) / group (GQA; an offset when a
  // tensor-parallel rank holds part of a kv head's group).
  void (*paged_attention)(float* out, const float* q, const void* k_cache, const void* v_cache,
                          DType cache_dtype, const int32_t* block_tables, int64_t max_blocks,
                          const int32_t* seq_lens, const int32_t* query_start_loc, int64_t num_seqs,
                          int64_t num_q_heads, int64_t num_kv_heads, int64_t group, int64_t q_head_offset,
                          int64_t head_dim,
                          int64_t block_size, float scale, int64_t sliding_window, float softcap,
                          int64_t q_stride, int64_t out_stride, float k_scale, float v_scale);
  // Packs W [N, K] (row-major, dtype wdt) into panels [ceil(N/nr)][K][nr], zero padded.
  void (*pack_weight)(void* dst, const void* src, DType wdt, int64_t n, int64_t k);
  // C[M, N] = A[M, K] @ W^T (+ bias), W packed by pack_weight. Every output element is
  // one fused multiply-add chain over k in order, whatever M or the thread count:
  // a row's result does not depend on the batch it is computed in.
  void (*gemm)(float* c, const float* a, const void* w_packed, DType wdt, const float* bias,
               int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldc);
  // act[M, F] = silu(A W[0:F]^T) * (A W[F:2F]^T), W [2F, K] packed by pack_weight: bit for bit
  // gemm() then silu_and_mul(), without the [M, 2F] projection between them (gated_gemm.hpp).
  void (*gemm_silu)(float* act, const float* a, const void* w_packed, DType wdt, int64_t m, int64_t f,
                    int64_t k, int64_t lda, int64_t ldo);
  // GGUF block-quantized weights (kernels/quant_format.hpp; qtype: ggml's type id).
  // qpack: n GGUF rows of k weights (fields in host byte order) -> panels of gemm_nr rows.
  void (*qpack)(uint8_t* dst, const uint8_t* src, int qtype, int64_t n, int64_t k);
  // As gemm, on a qpacked weight: bit for bit gemm() on the dequantized weight.
  void (*qgemm)(float* c, const float* a, const uint8_t* w, int qtype, const float* bias, int64_t m,
                int64_t n, int64_t k, int64_t lda, int64_t ldc);
  // As gemm_silu, on a qpacked [2F, K] weight: bit for bit qgemm() then silu_and_mul().
  void (*qgemm_silu)(float* act, const float* a, const uint8_t* w, int qtype, int64_t m, int64_t f, int64_t k,
                     int64_t lda, int64_t ldo);
  // out[i, :k] = row ids[i] of a qpacked weight, dequantized (embedding lookups).
  void (*qrows)(float* out, const uint8_t* w, int qtype, const int64_t* ids, int64_t count, int64_t k);
  // W8A8 (kernels/int8.hpp): int8 weights with per-output-channel scales, activations
  // quantized per token (symmetric, or with a zero point when act_asym). Exact integer sums,
  // so every table gives the same bits.
  int64_t (*i8packed_bytes)(int64_t n, int64_t k);
  void (*i8pack)(uint8_t* dst, const int8_t* w, const float* scale, int64_t n, int64_t k);
  void (*i8gemm)(float* c, const float* a, const uint8_t* w, const float* bias, int64_t m, int64_t n, int64_t k,
                 int64_t lda, int64_t ldc, bool act_asym);
  // As gemm_silu, on an i8packed [2F, K] weight: bit for bit i8gemm() then silu_and_mul().
  void (*i8gemm_silu)(float* act, const float* a, const uint8_t* w, int64_t m, int64_t f, int64_t k, int64_t lda,
                      int64_t ldo, bool act_asym);
  // GGUF blocks on int8 dot products (kernels/qdot.hpp): each weight's code and its group's scale
  // and offset, activations quantized to int8 per group (the types of at most 6-bit codes;
  // qdpacked_bytes is -1 for the others). Exact integer sums: every table gives the same bits.
  int64_t (*qdpacked_bytes)(int qtype, int64_t n, int64_t k);
  void (*qdpack)(uint8_t* dst, const uint8_t* src, int qtype, int64_t n, int64_t k);
  void (*qdgemm)(float* c, const float* a, const uint8_t* w, int qtype, const float* bias, int64_t m,
                 int64_t n, int64_t k, int64_t lda, int64_t ldc);
  // As gemm_silu, on a qdpacked [2F, K] weight: bit for bit qdgemm() then silu_and_mul().
  void (*qdgemm_silu)(float* act, const float* a, const uint8_t* w, int qtype, int64_t m, int64_t f, int64_t k,
                      int64_t lda, int64_t ldo);
  void (*qdrows)(float* out, const uint8_t* w, int qtype, const int64_t* ids, int64_t count, int64_t k);
  // The sum of x[0, n), every thread streaming its share (kernels/stream.hpp: the bandwidth probe).
  float (*read_sum)(const float* x, int64_t n);
  // FLOPs of `steps` steps of independent multiply-add chains on every thread, float FMAs or
  // bfloat16 pair dot products (-1 where the table has none): the arithmetic peak (kernels/peak.hpp).
  double (*peak_flops)(bool pairs, int64_t steps);
  // out[r] = torch.argmax(x[r, :n]): the first index of the largest value, a NaN the largest.
  void (*argmax)(int64_t* out, const float* x, int64_t rows, int64_t n, int64_t x_stride);
  // out[r] = argmax(x[r] @ W^T) for a float32 W [n, k] packed by pack_weight, decided from approx =
  // x @ copy(W)^T and norms: bound 0, a bfloat16 copy and norms[t] >= |W_t|; bound 1, any copy and
  // norms[t] >= its error per unit |x| (kernels/greedy_head.hpp); -1 where undecided, whose count
  // it returns. The same answer as argmax(gemm(x, W)) on every table.
  int64_t (*greedy_head)(int64_t* out, const float* approx, int64_t approx_stride, const float* x, int64_t x_stride,
                         const float* w, const float* norms, float norm_max, int bound, int64_t rows, int64_t n,
                         int64_t k);
};

// Every ISA name, best first: a CPU with a variant (amx = avx512_bf16 + bfloat16 GEMMs on AMX
// tiles, avx512_bf16 = avx512_vnni + bf16 pair dot products, avx512_vnni, neon_dotprod) also runs the plain table, which the tests compare against.
constexpr const char* kIsaNames[] = {"amx", "avx512_bf16", "avx512_vnni", "avx512", "avx2", "neon_dotprod", "neon", "vxe", "scalar"};

// Tables compiled into this build (nullptr where the ISA is not built).
const KernelTable* table_scalar();
const KernelTable* table_avx2();
const KernelTable* table_avx512();
const KernelTable* table_avx512_vnni();
const KernelTable* table_avx512_bf16();
const KernelTable* table_amx();
const KernelTable* table_neon();
const KernelTable* table_neon_dotprod();
const KernelTable* table_vxe();

// The best table the running CPU supports, or the one named by the
// CPUSERVE_ISA environment variable (one of kIsaNames).
const KernelTable* best_table();
const KernelTable* table_by_name(const char* name);

}  // namespace cpuserve
