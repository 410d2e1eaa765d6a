#include "decoder_step.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace cpuserve {

void DecoderStack::linear(const LinearDesc& l, const float* x, int64_t lda, float* out, int64_t ldc, int64_t m) {
  int64_t col = 0;
  for (const LinearPart& p : l.parts) {
    const float* b = l.bias != nullptr ? l.bias + col : nullptr;
    if (p.kind >= kQDotKind)
      t_->qdgemm(out + col, x, static_cast<const uint8_t*>(p.w), p.kind - kQDotKind, b, m, p.n, l.k, lda, ldc);
    else if (p.kind >= kInt8Kind)
      t_->i8gemm(out + col, x, static_cast<const uint8_t*>(p.w), b, m, p.n, l.k, lda, ldc, p.kind == kInt8Kind + 1);
    else if (p.kind >= 16)
      t_->qgemm(out + col, x, static_cast<const uint8_t*>(p.w), p.kind - 16, b, m, p.n, l.k, lda, ldc);
    else
      t_->gemm(out + col, x, p.w, static_cast<DType>(p.kind), b, m, p.n, l.k, lda, ldc);
    col += p.n;
  }
}

// The Python LlamaDecoderLayer.__call__, kernel for kernel.
void DecoderStack::layer(const DecoderLayerDesc& L, float* h, float* res, bool first, const StepMeta& m) {
  const int64_t T = m.tokens, H = hidden_, qs = L.hq * L.d, kvs = L.hk * L.d, w = qs + 2 * kvs;
  if (first) {
    std::memcpy(res, h, sizeof(float) * T * H);
    timed(kRmsNorm, [&] { t_->rms_norm(h, res, L.in_norm, T, H, H, H, L.eps); });
  } else {
    timed(kAddRmsNorm, [&] { t_->fused_add_rms_norm(h, res, L.in_norm, T, H, H, H, L.eps); });
  }
  float* qkv = qkv_.data();
  timed(kGemm, [&] { linear(L.qkv, h, H, qkv, w, T); });
  float *q = qkv, *k = qkv + qs, *v = qkv + qs + kvs;
  if (L.q_norm != nullptr)
    timed(kRmsNorm, [&] {
      for (int64_t i = 0; i < T; ++i) {
        t_->rms_norm(q + i * w, q + i * w, L.q_norm, L.hq, L.d, L.d, L.d, L.eps);
        t_->rms_norm(k + i * w, k + i * w, L.k_norm, L.hk, L.d, L.d, L.d, L.eps);
      }
    });
  timed(kRotary, [&] { t_->rotary(q, k, m.positions, L.cos_sin, T, L.hq, L.hk, L.d, L.rot_dim, w, w, L.neox); });
  timed(kCacheWrite, [&] {
    t_->reshape_and_cache(k, v, L.k_cache, L.v_cache, L.kv_dtype, m.slot_mapping, T, L.hk, L.d, L.block_size, w, w,
                          L.k_scale, L.v_scale);
  });
  float* attn = attn_.data();
  timed(kAttention, [&] {
    t_->paged_attention(attn, q, L.k_cache, L.v_cache, L.kv_dtype, m.block_tables, m.max_blocks, m.seq_lens,
                        m.query_start_loc, m.num_seqs, L.hq, L.hk, L.group, L.q_off, L.d, L.block_size, L.scale,
                        L.window, L.softcap, w, qs, L.k_scale, L.v_scale);
  });
  timed(kGemm, [&] { linear(L.o, attn, qs, h, H, T); });
  timed(kAddRmsNorm, [&] { t_->fused_add_rms_norm(h, res, L.post_norm, T, H, H, H, L.eps); });
  gated_mlp_input(L.gate_up, h, T);
  timed(kGemm, [&] { linear(L.down, act_.data(), inter_, h, H, T); });
}

// The weight kind of a gate_up projection with one part and no bias, else -1.
static int gate_up_kind(const LinearDesc& gu) {
  return gu.parts.size() == 1 && gu.bias == nullptr ? gu.parts[0].kind : -1;
}

// Whether a fused kernel applies SiLU-and-mul to it (every kind of weight); the others (several
// parts, a bias) go through gate_up_ and silu_and_mul.
static bool fused_gate_up(const LinearDesc& gu) { return gate_up_kind(gu) >= 0; }

// act_ = silu(gate) * up of the merged gate_up projection of h: one fused pass over dense,
// GGUF and W8A8 weights (ops.linear_silu's rule, the same bits as the two kernels apart).
void DecoderStack::gated_mlp_input(const LinearDesc& gu, const float* h, int64_t T) {
  const int64_t H = hidden_;
  const int kind = gate_up_kind(gu);
  if (kind < 0) {
    timed(kGemm, [&] { linear(gu, h, H, gate_up_.data(), 2 * inter_, T); });
    timed(kActivation, [&] { t_->silu_and_mul(act_.data(), gate_up_.data(), T, inter_, 2 * inter_, inter_); });
    return;
  }
  timed(kGemm, [&] { fused_gated_mlp_input(kind, gu, h, T); });
}

// gated_mlp_input's one-kernel path for a gate_up of weight kind `kind`.
void DecoderStack::fused_gated_mlp_input(int kind, const LinearDesc& gu, const float* h, int64_t T) {
  const int64_t H = hidden_;
  if (kind < 16) {
    t_->gemm_silu(act_.data(), h, gu.parts[0].w, static_cast<DType>(kind), T, inter_, H, H, inter_);
    return;
  }
  if (kind >= kInt8Kind && kind < kQDotKind) {
    t_->i8gemm_silu(act_.data(), h, static_cast<const uint8_t*>(gu.parts[0].w), T, inter_, H, H, inter_,
                    kind == kInt8Kind + 1);
    return;
  }
  if (kind >= 16 && kind < kInt8Kind) {
    t_->qgemm_silu(act_.data(), h, static_cast<const uint8_t*>(gu.parts[0].w), kind - 16, T, inter_, H, H, inter_);
    return;
  }
  t_->qdgemm_silu(act_.data(), h, static_cast<const uint8_t*>(gu.parts[0].w), kind - kQDotKind, T, inter_, H, H,
                  inter_);
}

void DecoderStack::set_embedding(const void* table, DType dt, int64_t rows) {
  if (dt != DType::F32 && dt != DType::BF16) throw std::invalid_argument("embedding table: float32 or bfloat16");
  table_ = table, table_dt_ = dt, table_rows_ = rows;
}

// h[t] = table[ids[t]] widened to float32 (torch's index then .float(): the same values).
void DecoderStack::embed(const int64_t* ids, float* h, int64_t T) const {
  if (table_ == nullptr) throw std::invalid_argument("token ids given to a decoder stack without an embedding");
  const int64_t H = hidden_;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = ids[t];
    if (id < 0 || id >= table_rows_)
      throw std::out_of_range("token id " + std::to_string(id) + " outside the embedding's " +
                              std::to_string(table_rows_) + " rows");
    float* out = h + t * H;
    if (table_dt_ == DType::F32) {
      std::memcpy(out, static_cast<const float*>(table_) + id * H, sizeof(float) * H);
      continue;
    }
    const bf16* row = static_cast<const bf16*>(table_) + id * H;
    for (int64_t e = 0; e < H; ++e) out[e] = to_float(row[e]);
  }
}

void DecoderStack::run(const int64_t* ids, float* h, float* residual, bool residual_valid, const StepMeta& m) {
  if (ids != nullptr) timed(kEmbedding, [&] { embed(ids, h, m.tokens); });
  int64_t qkv_w = 0, q_w = 0;
  bool unfused = false;  // a layer whose gate/up goes through gate_up_ (most models: none)
  for (const DecoderLayerDesc& L : layers_) {
    qkv_w = std::max(qkv_w, (L.hq + 2 * L.hk) * L.d);
    q_w = std::max(q_w, L.hq * L.d);
    unfused |= !fused_gate_up(L.gate_up);
  }
  const size_t T = static_cast<size_t>(m.tokens);
  qkv_.reserve(T * qkv_w);
  attn_.reserve(T * q_w);
  if (unfused) gate_up_.reserve(T * 2 * inter_);
  act_.reserve(T * inter_);
  bool first = !residual_valid;
  for (const DecoderLayerDesc& L : layers_) {
    layer(L, h, residual, first, m);
    first = false;
  }
  if (final_norm_ != nullptr)
    timed(kAddRmsNorm,
          [&] { t_->fused_add_rms_norm(h, residual, final_norm_, m.tokens, hidden_, hidden_, hidden_, final_eps_); });
}

}  // namespace cpuserve
