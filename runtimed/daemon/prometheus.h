// Prometheus text exposition (format 0.0.4) of the engine's stats, served on 127.0.0.1 only.
#pragma once

#include <string>
#include <vector>

#include "membar/types.h"

namespace membar::runtimed {

// `# HELP` / `# TYPE` lines and one sample per tier, client and counter of every device. A daemon
// of several devices labels each sample with device="N" (tiers, clients and spaces are per
// device); one of a single device writes no device label, as before devices were added.
std::string format_prometheus(const std::vector<DeviceRuntimeStats>& devices);
// One device (no device label).
std::string format_prometheus(const RuntimeStats& stats);

}  // namespace membar::runtimed
