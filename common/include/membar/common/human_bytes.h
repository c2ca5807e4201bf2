// Byte counts for people: "512 MiB", "1.5 GiB" (binary units, one decimal when not whole).
#pragma once

#include <cstdint>
#include <string>

namespace membar {

std::string human_bytes(uint64_t bytes);

}  // namespace membar
