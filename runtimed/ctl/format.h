// membarctl's views of RuntimeStats: sectioned `key: value` text with human units beside raw
// numbers (Valkey's INFO), its JSON twin, and the one-screen table of `membarctl top`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "membar/common/human_bytes.h"
#include "membar/types.h"

namespace membar::ctl {

std::string human_duration_ns(uint64_t ns);

// Each device's tiers, clients and spaces (Note [Devices of one daemon] in
// membar/protocol/v2.h), the daemon's first device first. The JSON keeps the keys of a
// one-device daemon: "tiers" are the first device's, "clients" and "spaces" list every device's
// (each with its "device"), "spaces_total" counts them all; "devices" has one entry per device.
std::string format_stats_text(const std::vector<DeviceRuntimeStats>& devices, const std::string& socket_path);
std::string format_stats_json(const std::vector<DeviceRuntimeStats>& devices, const std::string& socket_path);
// `previous` (may be empty) gives rates over `interval_s`.
std::string format_top(const std::vector<DeviceRuntimeStats>& devices, const std::vector<DeviceRuntimeStats>& previous,
                       double interval_s, const std::string& socket_path);

}  // namespace membar::ctl
