// The shared-memory communicator between two real processes (fork), on every
// architecture the suite runs on: natively, and under qemu for arm64 (a weakly
// ordered memory model: the flags' acquire/release must carry the data) and s390x.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <string>
#include <vector>

#include "comm/shm_comm.hpp"

using cpuserve::CommDType;
using cpuserve::ShmComm;

namespace {

float value(int rank, int64_t i) { return std::sin(0.001f * static_cast<float>(i) + rank) * (rank + 1); }

// Runs the exchange as `rank`; returns the number of wrong elements.
int64_t exchange(ShmComm& c, int rank) {
  int64_t wrong = 0;
  for (int64_t n : {int64_t(1), int64_t(17), int64_t(4096), int64_t(70001), int64_t(300000)}) {
    for (int rep = 0; rep < 3; ++rep) {  // repeated: slots are reused across parities
      std::vector<float> x(n);
      for (int64_t i = 0; i < n; ++i) x[i] = value(rank, i + rep);
      c.all_reduce(x.data(), n, CommDType::F32);
      for (int64_t i = 0; i < n; ++i) {
        float want = value(0, i + rep) + value(1, i + rep);
        if (x[i] != want) ++wrong;
      }
    }
  }
  std::vector<int64_t> bytes = {4 * 1000, 4 * 70000};  // uneven, the second spans several slots
  std::vector<float> mine(bytes[rank] / 4, static_cast<float>(rank + 1));
  std::vector<float> all((bytes[0] + bytes[1]) / 4);
  c.all_gather(mine.data(), all.data(), bytes);
  for (size_t i = 0; i < all.size(); ++i)
    if (all[i] != (i < 1000 ? 1.0f : 2.0f)) ++wrong;
  c.barrier();
  return wrong;
}

}  // namespace

TEST(ShmComm, TwoProcessesAllReduceAndGather) {
  const std::string name = "/cpuserve-gtest-" + std::to_string(getpid());
  ShmComm c0(name, 0, 2, 64 * 1024);  // small slots: large tensors go in several pieces
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int rc = 3;
    try {
      ShmComm c1(name, 1, 2, 64 * 1024);
      rc = exchange(c1, 1) == 0 ? 0 : 1;
    } catch (...) {
      rc = 2;
    }
    _exit(rc);
  }
  EXPECT_EQ(exchange(c0, 0), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(ShmComm, DeadPeerThrowsInsteadOfHanging) {
  const std::string name = "/cpuserve-gtest-dead-" + std::to_string(getpid());
  ShmComm c0(name, 0, 2, 64 * 1024);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ShmComm c1(name, 1, 2, 64 * 1024);  // attach, then leave without taking part
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);  // reaped: /proc has no entry left
  float x = 1.0f;
  EXPECT_THROW(c0.all_reduce(&x, 1, CommDType::F32), std::runtime_error);
}
