#include "membar/common/human_bytes.h"

#include <cstdio>

namespace membar {

std::string human_bytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  char text[48];
  if (value == static_cast<double>(static_cast<uint64_t>(value))) {
    std::snprintf(text, sizeof(text), "%llu %s", static_cast<unsigned long long>(value), units[unit]);
  } else {
    std::snprintf(text, sizeof(text), "%.1f %s", value, units[unit]);
  }
  return text;
}

}  // namespace membar
