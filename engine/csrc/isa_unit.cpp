// One kernel table for one ISA. CMake compiles this file once per ISA with
// CPUSERVE_ISA_<NAME> and CPUSERVE_TABLE_FN=table_<name> defined and that ISA's
// flags; everything it includes has internal linkage, so the copies never mix.
#include "kernel_table.hpp"
#include "kernels/activation.hpp"
#include "kernels/argmax.hpp"
#include "kernels/attention.hpp"
#include "kernels/cache.hpp"
#include "kernels/gated_gemm.hpp"
#include "kernels/gemm.hpp"
#include "kernels/greedy_head.hpp"
#include "kernels/int8.hpp"
#include "kernels/norm.hpp"
#include "kernels/peak.hpp"
#include "kernels/qdot.hpp"
#include "kernels/quant.hpp"
#include "kernels/rotary.hpp"
#include "kernels/stream.hpp"

#ifndef CPUSERVE_TABLE_FN
#error "CPUSERVE_TABLE_FN must name the table function (e.g. table_avx2)"
#endif

namespace cpuserve {

const KernelTable* CPUSERVE_TABLE_FN() {
  static const KernelTable table = {
      VecF::kIsa,
      VecF::N,
      kNR,
      kBf16Pairs,
      kBf16KAlign,
      &rms_norm_impl,
      &fused_add_rms_norm_impl,
      &rotary_impl,
      &silu_and_mul_impl,
      &gelu_and_mul_impl,
      &reshape_and_cache_impl,
      &paged_attention_impl,
      &pack_weight_impl,
      &gemm_impl,
      &gemm_silu_impl,
      &qpack_impl,
      &qgemm_impl,
      &qgemm_silu_impl,
      &qrows_impl,
      &i8packed_bytes_impl,
      &i8pack_impl,
      &i8gemm_impl,
      &i8gemm_silu_impl,
      &qdpacked_bytes_impl,
      &qdpack_impl,
      &qdgemm_impl,
      &qdgemm_silu_impl,
      &qdrows_impl,
      &read_sum_impl,
      &peak_flops_impl,
      &argmax_impl,
      &greedy_head_impl,
  };
  return &table;
}

}  // namespace cpuserve
