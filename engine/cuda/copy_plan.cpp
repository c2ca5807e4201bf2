#include "membar/engine/copy_plan.h"

#include <algorithm>
#include <functional>

namespace membar::runtimed {

void copy_plan_merge(std::vector<Transfer>& transfers) {
  std::sort(transfers.begin(), transfers.end(),
            [](const Transfer& a, const Transfer& b) { return std::less<const char*>()(a.source, b.source); });
  size_t merged = 0;
  for (size_t i = 0; i < transfers.size(); ++i) {
    if (merged > 0) {
      Transfer& last = transfers[merged - 1];
      if (last.source + last.bytes == transfers[i].source && last.destination + last.bytes == transfers[i].destination) {
        last.bytes += transfers[i].bytes;
        continue;
      }
    }
    transfers[merged++] = transfers[i];
  }
  transfers.resize(merged);
}

void copy_plan_split(std::vector<Transfer>& transfers, const char* region_begin, const char* region_end,
                     uint64_t boundary) {
  auto in_region = [&](const char* pointer) {
    return std::less_equal<const char*>()(region_begin, pointer) && std::less<const char*>()(pointer, region_end);
  };
  std::vector<Transfer> pieces;
  pieces.reserve(transfers.size());
  for (Transfer transfer : transfers) {
    while (transfer.bytes > 0) {
      uint64_t piece = transfer.bytes;
      for (const char* pointer : {transfer.source, transfer.destination}) {
        if (!in_region(pointer)) continue;
        uint64_t into_unit = static_cast<uint64_t>(pointer - region_begin) % boundary;
        piece = std::min(piece, boundary - into_unit);
      }
      pieces.push_back(Transfer{transfer.source, transfer.destination, piece});
      transfer.source += piece;
      transfer.destination += piece;
      transfer.bytes -= piece;
    }
  }
  transfers.swap(pieces);
}

}  // namespace membar::runtimed
