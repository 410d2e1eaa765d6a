#include "comm/shm_comm.hpp"

#include <fcntl.h>
#include <omp.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "dtype.hpp"

namespace cpuserve {

namespace {

constexpr uint64_t kMagic = 0x6370757365727665ull;  // "cpuserve"
constexpr int64_t kParallelMin = 1 << 16;           // elements before OpenMP is worth waking

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#else
  asm volatile("" ::: "memory");
#endif
}

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

// A process is gone when /proc has no entry for it or it is a zombie.
bool process_alive(int pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close = std::strrchr(buf, ')');  // comm may contain spaces and parentheses
  if (close == nullptr || close[1] == 0) return true;
  char state = close[2];
  return state != 'Z' && state != 'X';
}

}  // namespace

struct alignas(64) Flag {
  std::atomic<uint64_t> seq;
  char pad[64 - sizeof(std::atomic<uint64_t>)];
};

struct ShmComm::Header {
  std::atomic<uint64_t> magic;
  int32_t world;
  int32_t reserved;
  int64_t slot_bytes;
  alignas(64) std::atomic<int32_t> aborted;  // 0, or (rank + 1) of the rank that aborted
  alignas(64) std::atomic<int32_t> pids[kMaxWorld];
  Flag flags[kMaxWorld];
};

size_t ShmComm::header_bytes() { return (sizeof(ShmComm::Header) + 4095) & ~size_t(4095); }

ShmComm::ShmComm(const std::string& name, int rank, int world, int64_t slot_bytes)
    : name_(name), rank_(rank), world_(world), slot_bytes_(slot_bytes) {
  if (world < 1 || world > kMaxWorld) throw std::invalid_argument("world size must be in [1, 64]");
  if (rank < 0 || rank >= world) throw std::invalid_argument("rank out of range");
  if (slot_bytes < 4096 || slot_bytes % 64) throw std::invalid_argument("slot_bytes must be a multiple of 64, >= 4096");
  map_bytes_ = header_bytes() + size_t(2) * world * size_t(slot_bytes);
  owner_ = rank == 0;
  int fd = shm_open(name.c_str(), owner_ ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(errno_text(("shm_open " + name).c_str()));
  if (owner_ && ftruncate(fd, static_cast<off_t>(map_bytes_)) != 0) {
    std::string err = errno_text("ftruncate of the shared-memory segment (is /dev/shm large enough?)");
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error(err);
  }
  if (!owner_) {
    struct stat st;
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < map_bytes_) {
      close(fd);
      throw std::runtime_error("shared-memory segment " + name + " is smaller than this rank expects");
    }
  }
  base_ = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    if (owner_) shm_unlink(name.c_str());
    throw std::runtime_error(errno_text("mmap of the shared-memory segment"));
  }
  hdr_ = static_cast<Header*>(base_);
  data_ = static_cast<char*>(base_) + header_bytes();
  if (owner_) {
    hdr_->world = world;
    hdr_->slot_bytes = slot_bytes;
    hdr_->aborted.store(0);
    for (int r = 0; r < kMaxWorld; ++r) {
      hdr_->pids[r].store(0);
      hdr_->flags[r].seq.store(0);
    }
    hdr_->magic.store(kMagic, std::memory_order_release);
  } else {
    if (hdr_->magic.load(std::memory_order_acquire) != kMagic || hdr_->world != world ||
        hdr_->slot_bytes != slot_bytes) {
      munmap(base_, map_bytes_);
      base_ = nullptr;
      throw std::runtime_error("shared-memory segment " + name + " was made for another group");
    }
  }
  hdr_->pids[rank].store(static_cast<int32_t>(getpid()), std::memory_order_release);
}

ShmComm::~ShmComm() {
  if (base_ != nullptr) munmap(base_, map_bytes_);
  if (owner_) shm_unlink(name_.c_str());  // harmless if already unlinked
}

void ShmComm::unlink() { shm_unlink(name_.c_str()); }

void ShmComm::abort() {
  int32_t expected = 0;
  hdr_->aborted.compare_exchange_strong(expected, rank_ + 1);
}

char* ShmComm::slot(uint64_t seq, int r) const {
  return data_ + (size_t(seq & 1) * world_ + r) * size_t(slot_bytes_);
}

void ShmComm::check_peers() {
  int32_t a = hdr_->aborted.load(std::memory_order_acquire);
  if (a != 0) throw std::runtime_error("tensor-parallel group aborted by rank " + std::to_string(a - 1));
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    int pid = hdr_->pids[r].load(std::memory_order_acquire);
    if (pid != 0 && !process_alive(pid)) {
      abort();
      throw std::runtime_error("tensor-parallel rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
                               ") has died");
    }
  }
}

static uint64_t now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

void ShmComm::publish_and_wait(uint64_t seq) {
  hdr_->flags[rank_].seq.store(seq, std::memory_order_release);
  const uint64_t t0 = now_ns();
  for (int r = 0; r < world_; ++r) {
    uint64_t spins = 0;
    while (hdr_->flags[r].seq.load(std::memory_order_acquire) < seq) {
      ++spins;
      if (spins < 20000) {
        cpu_relax();
        if ((spins & 1023) == 0 && hdr_->aborted.load(std::memory_order_relaxed) != 0) check_peers();
      } else if (spins < 22000) {
        sched_yield();
      } else {
        struct timespec ts{0, 50000};  // 50 us
        nanosleep(&ts, nullptr);
        if ((spins & 255) == 0) check_peers();  // about every 13 ms asleep
      }
    }
  }
  wait_ns_ += now_ns() - t0;
  if (hdr_->aborted.load(std::memory_order_acquire) != 0) check_peers();
}

void ShmComm::barrier() { publish_and_wait(++seq_); }

void ShmComm::all_reduce(void* data, int64_t n, CommDType dtype) {
  const int64_t chunk = slot_bytes_ / static_cast<int64_t>(sizeof(float));
  for (int64_t off = 0; off < n; off += chunk) {
    const int64_t m = std::min(chunk, n - off);
    const uint64_t s = ++seq_;
    float* mine = reinterpret_cast<float*>(slot(s, rank_));
    const bool par = m >= kParallelMin;
    if (dtype == CommDType::F32) {
      std::memcpy(mine, static_cast<const float*>(data) + off, size_t(m) * sizeof(float));
    } else {
      const bf16* src = static_cast<const bf16*>(data) + off;
#pragma omp parallel for schedule(static) if (par)
      for (int64_t i = 0; i < m; ++i) mine[i] = to_float(src[i]);
    }
    publish_and_wait(s);
    const float* slots[kMaxWorld];
    for (int r = 0; r < world_; ++r) slots[r] = reinterpret_cast<const float*>(slot(s, r));
    const int w = world_;
    if (dtype == CommDType::F32) {
      float* dst = static_cast<float*>(data) + off;
#pragma omp parallel for schedule(static) if (par)
      for (int64_t i = 0; i < m; ++i) {
        float acc = slots[0][i];
        for (int r = 1; r < w; ++r) acc += slots[r][i];
        dst[i] = acc;
      }
    } else {
      bf16* dst = static_cast<bf16*>(data) + off;
#pragma omp parallel for schedule(static) if (par)
      for (int64_t i = 0; i < m; ++i) {
        float acc = slots[0][i];
        for (int r = 1; r < w; ++r) acc += slots[r][i];
        dst[i] = from_float<bf16>(acc);
      }
    }
  }
}

void ShmComm::all_gather(const void* in, void* out, const std::vector<int64_t>& bytes_per_rank) {
  if (static_cast<int>(bytes_per_rank.size()) != world_)
    throw std::invalid_argument("all_gather needs one byte count per rank");
  int64_t rounds = 0;
  std::vector<int64_t> offsets(world_ + 1, 0);
  for (int r = 0; r < world_; ++r) {
    if (bytes_per_rank[r] < 0) throw std::invalid_argument("negative byte count");
    rounds = std::max(rounds, (bytes_per_rank[r] + slot_bytes_ - 1) / slot_bytes_);
    offsets[r + 1] = offsets[r] + bytes_per_rank[r];
  }
  for (int64_t k = 0; k < rounds; ++k) {
    const uint64_t s = ++seq_;
    const int64_t lo = k * slot_bytes_;
    const int64_t mine = std::max<int64_t>(0, std::min(slot_bytes_, bytes_per_rank[rank_] - lo));
    if (mine > 0) std::memcpy(slot(s, rank_), static_cast<const char*>(in) + lo, size_t(mine));
    publish_and_wait(s);
    for (int r = 0; r < world_; ++r) {
      const int64_t len = std::max<int64_t>(0, std::min(slot_bytes_, bytes_per_rank[r] - lo));
      if (len > 0) std::memcpy(static_cast<char*>(out) + offsets[r] + lo, slot(s, r), size_t(len));
    }
  }
}

}  // namespace cpuserve
