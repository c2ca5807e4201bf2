// One host pool for a node's devices (Note [One host pool for a node] in engine/host_share.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

namespace membar::runtimed {

// How many host slabs the engines of one daemon (one per device) may hold backed by memory at
// once, and a way for one engine to ask the others to give back slabs they are not using.
// Thread-safe. The callbacks of a member are called with the share's lock held: `spare` must only
// read an atomic, `asked` must only set a flag and wake the member's own thread.
class HostShare {
 public:
  explicit HostShare(uint64_t slabs) : left_(slabs), slabs_(slabs) {}

  uint64_t slabs() const { return slabs_; }
  // Capacity for one more backed slab: false when every slab of the node is backed somewhere.
  bool take();
  // A released slab's capacity comes back (and answers one ask, if any is outstanding).
  void give_back();
  // A member that was asked has nothing left to release: the ask is answered with nothing.
  void cancel_ask();
  uint64_t left();
  // Slabs `member` could get on request: capacity nobody holds backed, and the slabs the other
  // members can spare.
  uint64_t obtainable(uint32_t member);

  // An engine joins with what it can spare (free backed slabs) and how to ask it for one.
  uint32_t join(std::function<uint64_t()> spare, std::function<void()> asked);
  void leave(uint32_t member);
  // Asks one other member that has a slab to spare (free, or being prepared) to release one; while
  // an ask is outstanding, asks again nobody. True when capacity is on its way (the caller should
  // tell its client to retry: it arrives once the slab is released).
  bool ask_others(uint32_t member);

 private:
  struct Member {
    bool present = false;
    std::function<uint64_t()> spare;
    std::function<void()> asked;
  };
  std::mutex mutex_;
  uint64_t left_;
  const uint64_t slabs_;
  uint64_t asks_ = 0;   // asks not yet answered by a release (or a cancel)
  std::vector<Member> members_;
};

}  // namespace membar::runtimed
