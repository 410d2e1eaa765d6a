// Thread pinning and NUMA memory policy: the calls libnuma's numa_set_membind,
// numa_migrate_pages and numa_run_on_node make, issued as raw system calls so
// that a refusal (EPERM without CAP_SYS_NICE, or from a container's seccomp
// profile) comes back as an errno for the caller to report once, instead of
// libnuma printing its own message on stderr for every call.
#pragma once
#include <cstddef>
#include <utility>
#include <vector>

namespace cpuserve {

constexpr int kMpolDefault = 0;
constexpr int kMpolBind = 2;

struct MemPolicy {
  int err;                 // 0, or the errno of get_mempolicy
  int mode;                // MPOL_* of the calling thread
  std::vector<int> nodes;  // its node mask
};

MemPolicy get_mempolicy();
int set_mempolicy(int mode, const std::vector<int>& nodes);  // calling thread; returns errno or 0
// Moves pages of `pid` (0 = this process) from `from` nodes to `to` nodes.
// Returns (errno or 0, number of pages that could not be moved).
std::pair<int, long> migrate_pages(int pid, const std::vector<int>& from, const std::vector<int>& to);
int set_thread_affinity(const std::vector<int>& cpus);  // calling thread; errno or 0
// Sizes the OpenMP pool to cpus.size(), pins thread i to cpus[i] and, when
// mem_node >= 0, binds each thread's memory to that node.
// Returns (first affinity errno or 0, first mempolicy errno or 0).
std::pair<int, int> bind_omp_threads(const std::vector<int>& cpus, int mem_node);
std::vector<int> omp_thread_cpus();  // the CPU each OpenMP thread runs on right now
// How long one cache line takes to pass between OpenMP thread 0 and each other thread t of the
// pool (entry t - 1), in ns one way: the median of `trials` ping-pongs of `rounds` round trips
// each. Tens of ns where the two cores share a cache (an L3), over a hundred across dies or
// sockets, where every parallel region's fork and barrier costs as much more. -1 for a thread
// that shares a CPU with thread 0 (each round trip a scheduler slice: given up after 0.2 s).
std::vector<double> line_transfer_ns(int rounds, int trials);
// Faults in the pages of [p, p + n) (its whole pages) as a write would, their contents unchanged
// (MADV_POPULATE_WRITE, Linux 5.14+), 64 MiB at a time over the OpenMP threads: each on its own
// CPU and under its memory binding. Returns the first errno, or 0.
int populate(void* p, size_t n);

}  // namespace cpuserve
