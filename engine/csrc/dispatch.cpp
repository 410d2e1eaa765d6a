// Picks the kernel table for the running CPU: the best ISA that was compiled in
// and that the CPU (and the OS, for AVX-512 register state) supports; and how its decode
// GEMVs fetch their weights (DecodeFetch, kernels/prefetch.hpp).
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include "kernel_table.hpp"
#include "kernels/prefetch.hpp"

#if defined(__s390x__) || defined(__aarch64__)
#include <sys/auxv.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__aarch64__) && !defined(HWCAP_ASIMDDP)
#define HWCAP_ASIMDDP (1 << 20)
#endif
#if defined(__s390x__)
#ifndef HWCAP_S390_VXRS_EXT
#define HWCAP_S390_VXRS_EXT 8192
#endif
#endif

namespace cpuserve {

#ifndef CPUSERVE_HAVE_AVX2
const KernelTable* table_avx2() { return nullptr; }
#endif
#ifndef CPUSERVE_HAVE_AVX512
const KernelTable* table_avx512() { return nullptr; }
#endif
#ifndef CPUSERVE_HAVE_AVX512_VNNI
const KernelTable* table_avx512_vnni() { return nullptr; }
#endif
#ifndef CPUSERVE_HAVE_AVX512_BF16
const KernelTable* table_avx512_bf16() { return nullptr; }
#endif
#ifndef CPUSERVE_HAVE_AMX
const KernelTable* table_amx() { return nullptr; }
#endif
#ifndef CPUSERVE_HAVE_NEON
const KernelTable* table_neon() { return nullptr; }
#endif
#ifndef CPUSERVE_HAVE_NEON_DOTPROD
const KernelTable* table_neon_dotprod() { return nullptr; }
#endif
#ifndef CPUSERVE_HAVE_VXE
const KernelTable* table_vxe() { return nullptr; }
#endif

namespace {

#if defined(__x86_64__)
// Linux hands out the AMX tile data state (XTILEDATA, 8 KiB a thread) only to a process that asks
// for it (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+); a kernel that refuses leaves the tiles
// unusable whatever CPUID says. Asked once; the permission covers every thread of the process.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}
#endif

bool cpu_has(const char* isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (std::strcmp(isa, "amx") == 0)
    return cpu_has("avx512_bf16") && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
           __builtin_cpu_supports("amx-int8") &&
           amx_permitted();
  if (std::strcmp(isa, "avx512_bf16") == 0) return cpu_has("avx512_vnni") && __builtin_cpu_supports("avx512bf16");
  if (std::strcmp(isa, "avx512_vnni") == 0) return cpu_has("avx512") && __builtin_cpu_supports("avx512vnni");
  if (std::strcmp(isa, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (std::strcmp(isa, "avx2") == 0)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#elif defined(__aarch64__)
  if (std::strcmp(isa, "neon") == 0) return true;  // Advanced SIMD is mandatory on AArch64
  if (std::strcmp(isa, "neon_dotprod") == 0) return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__s390x__)
  if (std::strcmp(isa, "vxe") == 0) return (getauxval(AT_HWCAP) & HWCAP_S390_VXRS_EXT) != 0;
#endif
  return std::strcmp(isa, "scalar") == 0;
}

}  // namespace

DecodeFetch decode_fetch_for(const char* vendor) {
  return std::strcmp(vendor, "GenuineIntel") == 0 ? DecodeFetch::kL2Ahead : DecodeFetch::kNonTemporal;
}

namespace {

// This CPU's CPUID vendor string ("" off x86).
std::string cpu_vendor() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return "";
  char v[13] = {};
  std::memcpy(v, &ebx, 4);
  std::memcpy(v + 4, &edx, 4);
  std::memcpy(v + 8, &ecx, 4);
  return v;
#else
  return "";
#endif
}

std::atomic<DecodeFetch>& decode_fetch_slot() {
  static std::atomic<DecodeFetch> f{decode_fetch_for(cpu_vendor().c_str())};
  return f;
}

}  // namespace

DecodeFetch decode_fetch() { return decode_fetch_slot().load(std::memory_order_relaxed); }
void set_decode_fetch(DecodeFetch f) { decode_fetch_slot().store(f, std::memory_order_relaxed); }

const KernelTable* table_by_name(const char* name) {
  const KernelTable* t = nullptr;
  if (std::strcmp(name, "scalar") == 0) t = table_scalar();
  else if (std::strcmp(name, "avx2") == 0) t = table_avx2();
  else if (std::strcmp(name, "avx512") == 0) t = table_avx512();
  else if (std::strcmp(name, "avx512_vnni") == 0) t = table_avx512_vnni();
  else if (std::strcmp(name, "avx512_bf16") == 0) t = table_avx512_bf16();
  else if (std::strcmp(name, "amx") == 0) t = table_amx();
  else if (std::strcmp(name, "neon") == 0) t = table_neon();
  else if (std::strcmp(name, "neon_dotprod") == 0) t = table_neon_dotprod();
  else if (std::strcmp(name, "vxe") == 0) t = table_vxe();
  return (t != nullptr && cpu_has(name)) ? t : nullptr;
}

const KernelTable* best_table() {
  const char* forced = std::getenv("CPUSERVE_ISA");
  if (forced != nullptr && *forced != '\0') {
    if (const KernelTable* t = table_by_name(forced)) return t;
  }
  for (const char* isa : kIsaNames)
    if (const KernelTable* t = table_by_name(isa)) return t;
  return table_scalar();
}

}  // namespace cpuserve
