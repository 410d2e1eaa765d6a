// All-reduce and all-gather between the tensor-parallel ranks of one machine,
// through one POSIX shared-memory segment.
//
// Each rank owns a slot per parity; an operation (sequence number s) copies the
// rank's data into slot[s & 1][rank], publishes s in its flag, waits until every
// rank has published s, and then reads what it needs. Every rank sums the slots
// in rank order with float32 accumulation, so all ranks get bit-identical
// results (they must: each continues the forward pass from them). One flag wait
// per operation suffices: a rank publishing s has finished operation s-1, and
// everyone waited for s-1 before starting s, so slot[s & 1] is free to reuse.
// Tensors larger than a slot go through in slot-sized pieces.
//
// Waiting spins briefly, then yields, then sleeps; while sleeping it checks that
// the other ranks' processes are still alive and whether any rank aborted, and
// throws instead of hanging when one has died.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace cpuserve {

enum class CommDType : int { F32 = 0, BF16 = 1 };

class ShmComm {
 public:
  static constexpr int kMaxWorld = 64;

  // Rank 0 creates the segment (fails if the name exists); others attach.
  ShmComm(const std::string& name, int rank, int world, int64_t slot_bytes);
  ~ShmComm();
  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  void all_reduce(void* data, int64_t n, CommDType dtype);
  // `in` holds this rank's bytes_per_rank[rank] bytes; `out` receives every rank's
  // bytes concatenated in rank order.
  void all_gather(const void* in, void* out, const std::vector<int64_t>& bytes_per_rank);
  void barrier();
  void abort();          // makes every rank's current and next operation throw
  void unlink();         // removes the name; the mapping stays valid
  int rank() const { return rank_; }
  int world() const { return world_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  uint64_t seq() const { return seq_; }
  // Seconds spent waiting for the other ranks to arrive (load imbalance), as
  // opposed to moving and summing data; reset with reset_wait().
  double wait_seconds() const { return wait_ns_ * 1e-9; }
  void reset_wait() { wait_ns_ = 0; }

 private:
  struct Header;
  static size_t header_bytes();
  void publish_and_wait(uint64_t seq);
  void check_peers();
  char* slot(uint64_t seq, int r) const;

  std::string name_;
  int rank_, world_;
  int64_t slot_bytes_;
  size_t map_bytes_ = 0;
  void* base_ = nullptr;
  Header* hdr_ = nullptr;
  char* data_ = nullptr;
  uint64_t seq_ = 0;
  uint64_t wait_ns_ = 0;
  bool owner_ = false;
};

}  // namespace cpuserve
