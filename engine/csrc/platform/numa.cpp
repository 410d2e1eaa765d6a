#include "platform/numa.hpp"

#include <omp.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdint>
#include <cstring>

namespace cpuserve {

namespace {

constexpr int kMaxNodes = 1024;
constexpr int kWords = kMaxNodes / (8 * sizeof(unsigned long));

struct NodeMask {
  unsigned long bits[kWords];
  NodeMask() { std::memset(bits, 0, sizeof bits); }
  explicit NodeMask(const std::vector<int>& nodes) : NodeMask() {
    for (int n : nodes)
      if (n >= 0 && n < kMaxNodes) bits[n / (8 * sizeof(unsigned long))] |= 1ul << (n % (8 * sizeof(unsigned long)));
  }
};

// The kernel reads maxnode - 1 bits (libnuma passes size + 1 as well).
constexpr unsigned long kMaxNodeArg = kMaxNodes + 1;

}  // namespace

MemPolicy get_mempolicy() {
  MemPolicy p{0, 0, {}};
  NodeMask mask;
  int mode = 0;
  if (syscall(SYS_get_mempolicy, &mode, mask.bits, kMaxNodeArg, nullptr, 0ul) != 0) {
    p.err = errno;
    return p;
  }
  p.mode = mode;
  for (int n = 0; n < kMaxNodes; ++n)
    if (mask.bits[n / (8 * sizeof(unsigned long))] >> (n % (8 * sizeof(unsigned long))) & 1ul) p.nodes.push_back(n);
  return p;
}

int set_mempolicy(int mode, const std::vector<int>& nodes) {
  NodeMask mask(nodes);
  long rc = mode == kMpolDefault ? syscall(SYS_set_mempolicy, mode, nullptr, 0ul)
                                 : syscall(SYS_set_mempolicy, mode, mask.bits, kMaxNodeArg);
  return rc == 0 ? 0 : errno;
}

std::pair<int, long> migrate_pages(int pid, const std::vector<int>& from, const std::vector<int>& to) {
  NodeMask f(from), t(to);
  long rc = syscall(SYS_migrate_pages, pid, kMaxNodeArg, f.bits, t.bits);
  if (rc < 0) return {errno, 0};
  return {0, rc};
}

int set_thread_affinity(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus)
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  return sched_setaffinity(0, sizeof set, &set) == 0 ? 0 : errno;  // 0: the calling thread
}

std::pair<int, int> bind_omp_threads(const std::vector<int>& cpus, int mem_node) {
  const int n = static_cast<int>(cpus.size());
  if (n == 0) return {EINVAL, 0};
  omp_set_num_threads(n);
  int aff_err = 0, mem_err = 0;
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    int a = set_thread_affinity({cpus[t]});
    int m = mem_node >= 0 ? set_mempolicy(kMpolBind, {mem_node}) : 0;
#pragma omp critical
    {
      if (a != 0 && aff_err == 0) aff_err = a;
      if (m != 0 && mem_err == 0) mem_err = m;
    }
  }
  return {aff_err, mem_err};
}

std::vector<int> omp_thread_cpus() {
  const int n = omp_get_max_threads();
  std::vector<int> out(n, -1);
#pragma omp parallel num_threads(n)
  out[omp_get_thread_num()] = sched_getcpu();
  return out;
}

namespace {

// Threads 0 and `other` bounce one line `rounds` times (the rest of the team waits); seconds a
// round trip, or a negative number where they gave up: two threads that share a CPU (a pool
// larger than its CPUs) take a scheduler slice a round trip, so thread 0 stops after 0.2 s.
double ping_pong(int other, int rounds) {
  constexpr int64_t kStop = -1;
  alignas(64) std::atomic<int64_t> flag{0};
  double seconds = -1;
#pragma omp parallel
  {
    const int t = omp_get_thread_num();
    const bool paired = omp_get_num_threads() > other;  // a team smaller than the pool: no partner
#pragma omp barrier
    if (t == 0 && paired) {
      const auto t0 = std::chrono::steady_clock::now();
      auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
      int64_t i = 0;
      for (; i < rounds; ++i) {
        flag.store(2 * i + 1, std::memory_order_release);
        while (flag.load(std::memory_order_acquire) != 2 * i + 2) {}
        if (i % 64 == 63 && elapsed() > 0.2) break;
      }
      if (i == rounds) seconds = elapsed() / rounds;
      flag.store(kStop, std::memory_order_release);
    } else if (t == other && paired) {
      for (int64_t i = 0;; ++i) {
        int64_t v;
        while ((v = flag.load(std::memory_order_acquire)) != 2 * i + 1 && v != kStop) {}
        if (v == kStop) break;
        flag.store(2 * i + 2, std::memory_order_release);
      }
    }
  }
  return seconds;
}

}  // namespace

std::vector<double> line_transfer_ns(int rounds, int trials) {
  const int n = omp_get_max_threads();
  rounds = std::max(rounds, 1);
  std::vector<double> out;
  for (int other = 1; other < n; ++other) {
    std::vector<double> ns(static_cast<size_t>(std::max(trials, 1)));
    for (double& x : ns) {
      const double s = ping_pong(other, rounds);
      x = s < 0 ? -1 : s / 2 * 1e9;
    }
    std::nth_element(ns.begin(), ns.begin() + ns.size() / 2, ns.end());
    out.push_back(ns[ns.size() / 2]);  // -1: the pair shares a CPU (or was preempted throughout)
  }
  return out;
}

int populate(void* p, size_t n) {
#ifdef MADV_POPULATE_WRITE
  constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#else
  constexpr int kPopulateWrite = 23;  // linux/mman.h, for older C library headers
#endif
  constexpr uintptr_t kChunk = 64u << 20;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + n) / page * page;
  if (hi <= lo) return 0;
  const int64_t chunks = static_cast<int64_t>((hi - lo + kChunk - 1) / kChunk);
  int err = 0;
#pragma omp parallel for schedule(dynamic)
  for (int64_t c = 0; c < chunks; ++c) {
    const uintptr_t at = lo + static_cast<uintptr_t>(c) * kChunk;
    if (madvise(reinterpret_cast<void*>(at), std::min<uintptr_t>(kChunk, hi - at), kPopulateWrite) != 0) {
#pragma omp critical
      if (err == 0) err = errno;
    }
  }
  return err;
}

}  // namespace cpuserve
