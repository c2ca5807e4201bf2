// Prometheus text exposition (format 0.0.4) of the engine's stats, served on 127.0.0.1 only.
#pragma once

#include <string>

#include "membar/types.h"

namespace membar::runtimed {

// `# HELP` / `# TYPE` lines and one sample per tier, client and counter.
std::string format_prometheus(const RuntimeStats& stats);

}  // namespace membar::runtimed
