// A Llama-family decoder stack run in one native call per step: the same kernels, in the
// same order and on the same buffers as the Python layers (so the same results, bit for
// bit), without a Python round trip per operator. Built once per model from the layers'
// weights and KV caches (cpuserve/model_executor/native_step.py); one rank only.
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <vector>
#include "../kernel_table.hpp"

namespace cpuserve {

constexpr int kInt8Kind = 256;
constexpr int kQDotKind = 512;  // + ggml type id: GGUF blocks on int8 dot products (kernels/qdot.hpp)

// A step's float scratch (a projection's output, the next one's input) on a 64-byte (cache-line)
// boundary, grown as steps need, its contents not kept across growth. glibc's malloc puts a large
// block 16 bytes past a page, so each row segment of 32 floats a GEMM stores (an AMX tile row, a
// panel's row of vector stores) touched three lines, not two: the AMX table's bfloat16 QKV GEMM of
// 2,048 rows (2,048 x 960 x 576, two threads, its output in L3, taking turns in one binary) 1,150
// GFLOP/s into a buffer 16 bytes past a line, 1,477 on one (x 3,072 x 576: 1,831 -> 2,247).
class LineScratch {
 public:
  float* data() const { return p_.get(); }
  void reserve(size_t n) {
    if (n <= n_) return;
    void* p = std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    p_.reset(static_cast<float*>(p));
    n_ = n;
  }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> p_;
  size_t n_ = 0;
};

struct LinearPart {
  const void* w;  // packed weight
  int kind;       // DType code for dense weights, 16 + ggml type id for quantized ones,
                  // kInt8Kind (+ 1 with asymmetric activations) for W8A8 ones,
                  // kQDotKind + ggml type id for GGUF blocks on int8 dot products
  int64_t n;      // output columns of this part
};

struct LinearDesc {
  std::vector<LinearPart> parts;
  int64_t k = 0, n = 0;
  const float* bias = nullptr;
};

struct DecoderLayerDesc {
  const float* in_norm = nullptr;
  const float* post_norm = nullptr;
  float eps = 1e-6f;
  LinearDesc qkv, o, gate_up, down;
  const float* q_norm = nullptr;  // per-head QK-norm (Qwen3), or null
  const float* k_norm = nullptr;
  int64_t hq = 0, hk = 0, d = 0, group = 1, q_off = 0;
  float scale = 1.f, softcap = 0.f;
  int64_t window = 0;
  const float* cos_sin = nullptr;
  int64_t rot_dim = 0;
  bool neox = true;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  DType kv_dtype = DType::F32;
  int64_t block_size = 16;
  float k_scale = 1.f, v_scale = 1.f;
};

struct StepMeta {
  int64_t tokens;
  const int64_t* positions;
  const int64_t* slot_mapping;
  const int32_t* block_tables;
  int64_t max_blocks;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t num_seqs;
};

// Where the stack's time goes, by kernel, while timing is on (DecoderStack::set_timing): what the
// Python layers' timers (entrypoints/bench.py StepProfile) see of the same kernels, which they
// cannot see inside this one call. Named as those timers name them; the gate/up projection with
// its fused SiLU-and-mul is GEMM.
enum StepPart : int { kEmbedding, kRmsNorm, kAddRmsNorm, kGemm, kRotary, kCacheWrite, kAttention, kActivation, kStepParts };
inline constexpr const char* kStepPartNames[kStepParts] = {
    "embedding", "rms_norm", "fused_add_rms_norm", "GEMM", "rotary", "reshape_and_cache", "attention", "silu_and_mul"};

class DecoderStack {
 public:
  DecoderStack(const KernelTable* t, int64_t hidden, int64_t intermediate) : t_(t), hidden_(hidden), inter_(intermediate) {}
  void add_layer(const DecoderLayerDesc& layer) { layers_.push_back(layer); }
  size_t size() const { return layers_.size(); }
  // The token embedding table [rows, hidden] (float32 or bfloat16), looked up by run() when it is
  // given token ids.
  void set_embedding(const void* table, DType dt, int64_t rows);
  // The model's final RMSNorm, applied by run() after the last layer.
  void set_final_norm(const float* w, float eps) { final_norm_ = w, final_eps_ = eps; }
  // h [T, hidden] in: the embeddings of `ids` (looked up here where ids is given), else the
  // embeddings (residual_valid false) or the previous layer's output; out: the last layer's
  // output (after the final norm where one is set), residual [T, hidden] its residual stream.
  // The lookup and the final norm are the Python model's own conversion and kernel, done here
  // to spare a decode step two Python calls (about 100 us with their state cold after the
  // weights streamed through the caches: 1.5% of a bfloat16 batch-1 step).
  void run(const int64_t* ids, float* h, float* residual, bool residual_valid, const StepMeta& m);
  // Timing of each kernel call by StepPart, summed over run() calls until reset: a clock read
  // before and after each kernel (about 600 a step of a 30-layer model, ~15 us); off (the
  // default), one predictable branch a kernel.
  void set_timing(bool on) { timing_ = on; }
  const std::array<double, kStepParts>& timings() const { return spent_; }
  void reset_timings() { spent_.fill(0.0); }

 private:
  template <typename F>
  void timed(StepPart part, F&& f) {
    if (!timing_) return f();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    spent_[part] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  void embed(const int64_t* ids, float* h, int64_t T) const;
  void linear(const LinearDesc& l, const float* x, int64_t lda, float* out, int64_t ldc, int64_t m);
  void layer(const DecoderLayerDesc& L, float* h, float* residual, bool first, const StepMeta& m);
  void gated_mlp_input(const LinearDesc& gate_up, const float* h, int64_t T);
  void fused_gated_mlp_input(int kind, const LinearDesc& gate_up, const float* h, int64_t T);

  const KernelTable* t_;
  int64_t hidden_, inter_;
  std::vector<DecoderLayerDesc> layers_;
  const void* table_ = nullptr;
  DType table_dt_ = DType::F32;
  int64_t table_rows_ = 0;
  const float* final_norm_ = nullptr;
  float final_eps_ = 0.f;
  LineScratch qkv_, attn_, gate_up_, act_;
  bool timing_ = false;
  std::array<double, kStepParts> spent_{};
};

}  // namespace cpuserve
