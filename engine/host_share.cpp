// Note [One host pool for a node]
// Rationale: one membard serves every GPU of a node, one engine per device (each with its own GPU
// pool, copy streams and page tables). Host memory is one for the node: a trainer alone on GPU 0
// of an 8-GPU node should be able to offload into the whole host pool, not an eighth of it, and a
// GPU's host pages should still come from its own NUMA node (Note [Host pools near their GPU]).
// Approach: every engine reserves address space for the whole node pool (no memory), cut into the
// same slabs; a HostShare counts how many slabs may be backed (memfd, pinned on CUDA) at once,
// node-wide. At start-up each engine backs an equal part of it. An engine that needs a slab and has
// none free backs one of its unbacked slabs if the share has capacity left; if not, it asks the
// other engines (HostShare::ask_others: one ask at a time, to an engine with a slab free or being
// prepared), and its client gets UNAVAILABLE (retry) meanwhile. An engine asked releases one free
// slab on its own thread (its memory unpinned and dropped: DeviceBackend::release_host_slab), or the
// next of its slabs to finish preparing, and the capacity returns to the share for the asker to
// back a slab on its own NUMA node; one with nothing left to give cancels the ask, and the asker's
// client is then told the node's pool is used up. Slabs held by clients are never taken for
// another device.
// Limitations: capacity moves a slab at a time and costs a release and a new pinning (about
// 0.4-0.8 s per GiB on the H200 VM); slabs a client holds but does not use (idle) are reclaimed
// only for clients of the same device, not released for another. A device's `membarctl stats`
// host tier counts the slabs it holds backed in frames_total, and what it could get from the
// others in frames_on_request (HostShare::obtainable: a snapshot; another device may take it
// first).
#include "membar/engine/host_share.h"

namespace membar::runtimed {

bool HostShare::take() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (left_ == 0) return false;
  --left_;
  return true;
}

void HostShare::give_back() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (left_ < slabs_) ++left_;
  if (asks_ > 0) --asks_;
}

void HostShare::cancel_ask() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (asks_ > 0) --asks_;
}

uint64_t HostShare::left() {
  std::lock_guard<std::mutex> lock(mutex_);
  return left_;
}

uint64_t HostShare::obtainable(uint32_t member) {
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t slabs = left_;
  for (uint32_t m = 0; m < members_.size(); ++m) {
    if (m != member && members_[m].present) slabs += members_[m].spare();
  }
  return slabs;
}

uint32_t HostShare::join(std::function<uint64_t()> spare, std::function<void()> asked) {
  std::lock_guard<std::mutex> lock(mutex_);
  members_.push_back(Member{true, std::move(spare), std::move(asked)});
  return static_cast<uint32_t>(members_.size() - 1);
}

void HostShare::leave(uint32_t member) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (member < members_.size()) members_[member] = Member{};
}

bool HostShare::ask_others(uint32_t member) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (asks_ > 0) return true;   // a slab is on its way
  for (uint32_t m = 0; m < members_.size(); ++m) {
    Member& other = members_[m];
    if (m == member || !other.present || other.spare() == 0) continue;
    other.asked();
    ++asks_;
    return true;
  }
  return false;
}

}  // namespace membar::runtimed
