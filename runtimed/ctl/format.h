// membarctl's views of RuntimeStats: sectioned `key: value` text with human units beside raw
// numbers (Valkey's INFO), its JSON twin, and the one-screen table of `membarctl top`.
#pragma once

#include <cstdint>
#include <string>

#include "membar/common/human_bytes.h"
#include "membar/types.h"

namespace membar::ctl {

std::string human_duration_ns(uint64_t ns);

std::string format_stats_text(const RuntimeStats& stats, const std::string& socket_path);
std::string format_stats_json(const RuntimeStats& stats, const std::string& socket_path);
// `previous` (may be null) gives rates over `interval_s`.
std::string format_top(const RuntimeStats& stats, const RuntimeStats* previous, double interval_s,
                       const std::string& socket_path);

}  // namespace membar::ctl
