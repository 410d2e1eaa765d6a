// reshape_and_cache: writes this step's keys and values into their cache slots.
// Cache layout [num_blocks, num_kv_heads, block_size, head_dim]: one (block, head)
// is a contiguous block_size x head_dim tile, which is what attention streams.
#pragma once
#include <type_traits>
#include "../vec/vec.hpp"

namespace cpuserve {
namespace {

// dst = src * inv_scale in the cache's dtype (inv_scale: 1 / the float8 cache's scale, else 1).
template <typename T>
inline void convert_row(T* dst, const float* src, int64_t n, float inv_scale) {
  int64_t i = 0;
  if (inv_scale == 1.f) {
    for (; i + VecF::N <= n; i += VecF::N) VecF::load(src + i).store(dst + i);
    for (; i < n; ++i) dst[i] = from_float<T>(src[i]);
    return;
  }
  const VecF sv = VecF::set1(inv_scale);
  for (; i + VecF::N <= n; i += VecF::N) (VecF::load(src + i) * sv).store(dst + i);
  for (; i < n; ++i) dst[i] = from_float<T>(src[i] * inv_scale);
}

template <typename T>
void reshape_and_cache_t(const float* key, const float* value, T* k_cache, T* v_cache,
                         const int64_t* slot_mapping, int64_t tokens, int64_t heads, int64_t d,
                         int64_t block_size, int64_t key_stride, int64_t value_stride, float k_inv, float v_inv) {
#pragma omp parallel for schedule(static) if (tokens > 8)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    const int64_t block = slot / block_size, off = slot % block_size;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t dst = ((block * heads + h) * block_size + off) * d;
      convert_row(k_cache + dst, key + t * key_stride + h * d, d, k_inv);
      convert_row(v_cache + dst, value + t * value_stride + h * d, d, v_inv);
    }
  }
}

void reshape_and_cache_impl(const float* key, const float* value, void* k_cache, void* v_cache,
                            DType dt, const int64_t* slot_mapping, int64_t tokens, int64_t heads,
                            int64_t d, int64_t block_size, int64_t key_stride, int64_t value_stride,
                            float k_scale, float v_scale) {
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    reshape_and_cache_t(key, value, static_cast<T*>(k_cache), static_cast<T*>(v_cache), slot_mapping, tokens,
                        heads, d, block_size, key_stride, value_stride, 1.f / k_scale, 1.f / v_scale);
  };
  switch (dt) {
    case DType::F32: return run(static_cast<float*>(nullptr));
    case DType::BF16: return run(static_cast<bf16*>(nullptr));
    case DType::F16: return run(static_cast<f16*>(nullptr));
    case DType::F8E5M2: return run(static_cast<f8e5m2*>(nullptr));
    case DType::F8E4M3: return run(static_cast<f8e4m3*>(nullptr));
  }
}

}  // namespace
}  // namespace cpuserve
