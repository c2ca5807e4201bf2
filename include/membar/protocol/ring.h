// Lock-free single-producer single-consumer rings over shared memory (protocol v2 layout), and
// the futex doorbell that lets a consumer sleep. Header-only, no dependencies beyond Linux.
//
// Note [Ring indices are private]
// Rationale: the two ends of a ring live in different processes, and the client is not trusted
// by the daemon. Approach: each end keeps its own index (the producer its head, the consumer its
// tail) in local memory and only publishes it to the segment; it never reads its own index back.
// The other end's index is read from the segment and checked (0 <= head - tail <= capacity);
// a violation is reported as DATA_LOSS, and the daemon drops that client. Entries are copied out
// of the segment before anything looks at them, so a client rewriting an entry after publishing
// it can only make its own request fail validation.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>

#include "membar/protocol/v2.h"

namespace membar::protocol {

static_assert(std::atomic_ref<uint64_t>::is_always_lock_free,
              "ring indices are shared across processes: they must be lock-free atomics");
static_assert(std::atomic_ref<uint32_t>::is_always_lock_free,
              "the doorbell is a futex word shared across processes");

// Futex on a word in a MAP_SHARED segment (no FUTEX_PRIVATE_FLAG: waker and sleeper are in
// different processes). Returns after a wake, a timeout, a signal, or at once if *word != expected.
inline void futex_wait(uint32_t* word, uint32_t expected, int64_t timeout_ns) {
  timespec timeout{static_cast<time_t>(timeout_ns / 1000000000), static_cast<long>(timeout_ns % 1000000000)};
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &timeout, nullptr, 0);
}
inline void futex_wake_all(uint32_t* word) {
  syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

inline uint64_t monotonic_ns() {
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<uint64_t>(now.tv_sec) * 1000000000ull + static_cast<uint64_t>(now.tv_nsec);
}

// One ring as seen from one end. Entry is RequestV2 or CompletionV2.
template <typename Entry>
class RingEnd {
 public:
  RingEnd() = default;
  // `control` points at the ring's RingControlV2 in the segment; entries follow it.
  RingEnd(void* control, uint32_t capacity)
      : control_(static_cast<v2::RingControlV2*>(control)),
        entries_(reinterpret_cast<Entry*>(static_cast<uint8_t*>(control) + sizeof(v2::RingControlV2))),
        capacity_(capacity) {}

  bool valid() const { return control_ != nullptr; }

  // Producer. Returns false when the ring is full (or the consumer published an impossible
  // tail, which looks the same: the producer cannot make progress).
  bool try_push(const Entry& entry) {
    uint64_t tail = std::atomic_ref<uint64_t>(control_->tail).load(std::memory_order_acquire);
    if (head_ - tail >= capacity_) return false;
    std::memcpy(&entries_[head_ & (capacity_ - 1)], &entry, sizeof(Entry));
    ++head_;
    std::atomic_ref<uint64_t>(control_->head).store(head_, std::memory_order_release);
    // Pairs with the consumer's fence in wait_for_entries: either it sees the new head or we
    // see its consumer_waiting flag (store-load ordering needs a full fence on both sides).
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (std::atomic_ref<uint32_t>(control_->consumer_waiting).load(std::memory_order_relaxed) != 0) {
      ring_doorbell();
    }
    return true;
  }

  // Wakes a sleeping consumer (also used to make it re-check a stop flag).
  void ring_doorbell() {
    std::atomic_ref<uint32_t>(control_->doorbell).fetch_add(1, std::memory_order_release);
    futex_wake_all(&control_->doorbell);
  }

  // Consumer. Returns 1 with an entry, 0 when empty, -1 when the producer's head is impossible.
  int try_pop(Entry& out) {
    uint64_t head = std::atomic_ref<uint64_t>(control_->head).load(std::memory_order_acquire);
    if (head == tail_) return 0;
    if (head - tail_ > capacity_) return -1;
    std::memcpy(&out, &entries_[tail_ & (capacity_ - 1)], sizeof(Entry));
    ++tail_;
    std::atomic_ref<uint64_t>(control_->tail).store(tail_, std::memory_order_release);
    return 1;
  }

  bool has_entries() const {
    return std::atomic_ref<uint64_t>(control_->head).load(std::memory_order_acquire) != tail_;
  }

  // Consumer: sleeps on the doorbell for at most timeout_ns unless an entry is already there.
  void wait_for_entries(int64_t timeout_ns) {
    auto doorbell = std::atomic_ref<uint32_t>(control_->doorbell);
    auto waiting = std::atomic_ref<uint32_t>(control_->consumer_waiting);
    uint32_t seen = doorbell.load(std::memory_order_acquire);
    waiting.store(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (!has_entries()) futex_wait(&control_->doorbell, seen, timeout_ns);
    waiting.store(0, std::memory_order_relaxed);
  }

  uint32_t capacity() const { return capacity_; }

 private:
  v2::RingControlV2* control_ = nullptr;
  Entry* entries_ = nullptr;
  uint32_t capacity_ = 0;
  uint64_t head_ = 0;  // producer's own index (Note [Ring indices are private])
  uint64_t tail_ = 0;  // consumer's own index
};

}  // namespace membar::protocol
