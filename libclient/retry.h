// Calls the runtime answers with "retry" (UNAVAILABLE while the frames or slabs a call needs are
// being cleared or pinned, Note [Frames, slabs and renewal]) are retried here, so that a trainer
// sees them only as a short delay: backing off from 100 us to 20 ms, for at most
// $MEMBAR_RETRY_MS milliseconds (default 60000). `still_alive` says whether an UNAVAILABLE means
// "retry" (true) or "the runtime is gone" (false: returned at once).
#pragma once

#include <chrono>
#include <cstdlib>
#include <thread>

#include "membar/status.h"

namespace membar {

inline uint64_t retry_budget_ms() {
  const char* text = std::getenv("MEMBAR_RETRY_MS");
  if (text == nullptr || *text == 0) return 60000;
  char* end = nullptr;
  unsigned long long value = std::strtoull(text, &end, 10);
  return end != text && *end == 0 ? value : 60000;
}

inline StatusCode code_of(const Status& status) { return status.code(); }
template <typename T>
StatusCode code_of(const Result<T>& result) {
  return result.ok() ? StatusCode::OK : result.status().code();
}

template <typename Call, typename Alive>
auto with_retry(Call&& call, Alive&& still_alive) -> decltype(call()) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(retry_budget_ms());
  auto pause = std::chrono::microseconds(100);
  for (;;) {
    auto result = call();
    if (code_of(result) != StatusCode::UNAVAILABLE || !still_alive() ||
        std::chrono::steady_clock::now() > deadline) {
      return result;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(20));
  }
}

}  // namespace membar
