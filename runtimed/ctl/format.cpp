#include "format.h"

#include <cinttypes>
#include <cstdio>
#include <map>
#include <sstream>

namespace membar::ctl {
namespace {

const char* tier_name(Tier tier) { return tier == Tier::kGpu ? "gpu" : "host"; }

std::string bytes_field(uint64_t bytes) { return std::to_string(bytes) + " (" + human_bytes(bytes) + ")"; }
std::string frames_field(int64_t frames) {
  return std::to_string(frames) + " (" + human_bytes(static_cast<uint64_t>(frames < 0 ? 0 : frames) * kFrameBytes) + ")";
}

double hit_rate(const ClientStats& c) {
  uint64_t total = c.prefetch_hits + c.prefetch_misses;
  return total == 0 ? 0.0 : static_cast<double>(c.prefetch_hits) / static_cast<double>(total);
}

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string json_stat(const Stat& s) {
  return "{\"current\": " + std::to_string(s.current) + ", \"peak\": " + std::to_string(s.peak) +
         ", \"allocated\": " + std::to_string(s.allocated) + ", \"freed\": " + std::to_string(s.freed) + "}";
}

}  // namespace


std::string human_duration_ns(uint64_t ns) {
  char text[32];
  if (ns < 1000) std::snprintf(text, sizeof(text), "%" PRIu64 " ns", ns);
  else if (ns < 1000000) std::snprintf(text, sizeof(text), "%.1f us", ns / 1e3);
  else if (ns < 1000000000) std::snprintf(text, sizeof(text), "%.1f ms", ns / 1e6);
  else std::snprintf(text, sizeof(text), "%.2f s", ns / 1e9);
  return text;
}

std::string format_stats_text(const RuntimeStats& stats, const std::string& socket_path) {
  std::ostringstream out;
  out << "# Server\n";
  out << "socket: " << socket_path << '\n';
  out << "backend: " << stats.backend << '\n';
  out << "clients: " << stats.clients.size() << '\n';
  out << "spaces: " << stats.spaces.size() << '\n';
  for (const TierStats& t : stats.tiers) {
    out << "\n# Tier " << tier_name(t.tier) << '\n';
    out << "frames_total: " << frames_field(static_cast<int64_t>(t.frames_total)) << '\n';
    out << "frames_used: " << frames_field(static_cast<int64_t>(t.frames_used)) << '\n';
    out << "frames_free: " << frames_field(static_cast<int64_t>(t.frames_free)) << '\n';
  }
  for (const ClientStats& c : stats.clients) {
    out << "\n# Client " << c.client << '\n';
    out << "name: " << c.name << '\n';
    out << "pid: " << c.pid << '\n';
    out << "gpu_quota: " << bytes_field(c.gpu_quota_bytes) << '\n';
    out << "host_quota: " << bytes_field(c.host_quota_bytes) << '\n';
    out << "gpu_frames: " << frames_field(c.gpu_frames.current) << '\n';
    out << "gpu_frames_peak: " << frames_field(c.gpu_frames.peak) << '\n';
    out << "host_frames: " << frames_field(c.host_frames.current) << '\n';
    out << "host_frames_peak: " << frames_field(c.host_frames.peak) << '\n';
    out << "pages_gpu: " << c.pages_gpu << '\n';
    out << "pages_host: " << c.pages_host << '\n';
    out << "pages_both: " << c.pages_both << '\n';
    out << "pages_none: " << c.pages_none << '\n';
    out << "bytes_host_to_gpu: " << bytes_field(c.bytes_host_to_gpu) << '\n';
    out << "bytes_gpu_to_host: " << bytes_field(c.bytes_gpu_to_host) << '\n';
    out << "prefetch_hits: " << c.prefetch_hits << '\n';
    out << "prefetch_misses: " << c.prefetch_misses << '\n';
    char rate[32];
    std::snprintf(rate, sizeof(rate), "%.4f (%.1f%%)", hit_rate(c), 100.0 * hit_rate(c));
    out << "prefetch_hit_rate: " << rate << '\n';
    out << "evictions: " << c.evictions << '\n';
    out << "stall_ns: " << c.stall_ns << " (" << human_duration_ns(c.stall_ns) << ")\n";
  }
  for (const SpaceInfo& s : stats.spaces) {
    out << "\n# Space " << s.id << '\n';
    out << "name: " << s.name << '\n';
    out << "page_bytes: " << bytes_field(s.page_bytes) << '\n';
    out << "page_count: " << s.page_count << '\n';
    out << "bytes: " << bytes_field(s.page_bytes * s.page_count) << '\n';
    out << "client: " << s.client << '\n';
    out << "pages_gpu: " << s.pages_gpu << '\n';
    out << "pages_host: " << s.pages_host << '\n';
    out << "pages_both: " << s.pages_both << '\n';
    out << "pages_none: " << s.pages_none << '\n';
    out << "pages_dirty: " << s.pages_dirty << '\n';
    out << "pages_pinned: " << s.pages_pinned << '\n';
  }
  return out.str();
}

std::string format_stats_json(const RuntimeStats& stats, const std::string& socket_path) {
  std::ostringstream out;
  out << "{\n  \"socket\": " << json_string(socket_path) << ",\n  \"backend\": " << json_string(stats.backend)
      << ",\n  \"tiers\": [";
  for (size_t i = 0; i < stats.tiers.size(); ++i) {
    const TierStats& t = stats.tiers[i];
    out << (i ? "," : "") << "\n    {\"tier\": \"" << tier_name(t.tier) << "\", \"frames_total\": " << t.frames_total
        << ", \"frames_used\": " << t.frames_used << ", \"frames_free\": " << t.frames_free
        << ", \"frame_bytes\": " << kFrameBytes << "}";
  }
  out << "\n  ],\n  \"clients\": [";
  for (size_t i = 0; i < stats.clients.size(); ++i) {
    const ClientStats& c = stats.clients[i];
    out << (i ? "," : "") << "\n    {\"client\": " << c.client << ", \"name\": " << json_string(c.name)
        << ", \"pid\": " << c.pid << ", \"gpu_quota_bytes\": " << c.gpu_quota_bytes
        << ", \"host_quota_bytes\": " << c.host_quota_bytes << ", \"gpu_frames\": " << json_stat(c.gpu_frames)
        << ", \"host_frames\": " << json_stat(c.host_frames) << ", \"pages_gpu\": " << c.pages_gpu
        << ", \"pages_host\": " << c.pages_host << ", \"pages_both\": " << c.pages_both
        << ", \"pages_none\": " << c.pages_none << ", \"bytes_host_to_gpu\": " << c.bytes_host_to_gpu
        << ", \"bytes_gpu_to_host\": " << c.bytes_gpu_to_host << ", \"prefetch_hits\": " << c.prefetch_hits
        << ", \"prefetch_misses\": " << c.prefetch_misses << ", \"prefetch_hit_rate\": " << hit_rate(c)
        << ", \"evictions\": " << c.evictions << ", \"stall_ns\": " << c.stall_ns << "}";
  }
  out << "\n  ],\n  \"spaces\": [";
  for (size_t i = 0; i < stats.spaces.size(); ++i) {
    const SpaceInfo& s = stats.spaces[i];
    out << (i ? "," : "") << "\n    {\"id\": " << s.id << ", \"name\": " << json_string(s.name)
        << ", \"page_bytes\": " << s.page_bytes << ", \"page_count\": " << s.page_count
        << ", \"client\": " << s.client << ", \"pages_gpu\": " << s.pages_gpu << ", \"pages_host\": " << s.pages_host
        << ", \"pages_both\": " << s.pages_both << ", \"pages_none\": " << s.pages_none
        << ", \"pages_dirty\": " << s.pages_dirty << ", \"pages_pinned\": " << s.pages_pinned << "}";
  }
  out << "\n  ]\n}\n";
  return out.str();
}

std::string format_top(const RuntimeStats& stats, const RuntimeStats* previous, double interval_s,
                       const std::string& socket_path) {
  std::map<ClientId, const ClientStats*> before;
  if (previous != nullptr) {
    for (const ClientStats& c : previous->clients) before[c.client] = &c;
  }
  std::ostringstream out;
  out << "membard " << socket_path << "  backend " << stats.backend << "  clients " << stats.clients.size() << '\n';
  for (const TierStats& t : stats.tiers) {
    char line[160];
    double used = t.frames_total ? 100.0 * static_cast<double>(t.frames_used) / static_cast<double>(t.frames_total) : 0;
    std::snprintf(line, sizeof(line), "%-4s frames %6" PRIu64 " used / %6" PRIu64 " total (%5.1f%%)  free %s\n",
                  tier_name(t.tier), t.frames_used, t.frames_total, used,
                  human_bytes(t.frames_free * kFrameBytes).c_str());
    out << line;
  }
  char header[256];
  std::snprintf(header, sizeof(header), "\n%6s %-16s %7s %6s %6s %8s %8s %8s %8s %11s %11s %6s %9s %10s\n", "CLIENT",
                "NAME", "PID", "GPU_F", "HOST_F", "P_GPU", "P_HOST", "P_BOTH", "P_NONE", "H2D/s", "D2H/s", "HIT%",
                "EVICT", "STALL");
  out << header;
  for (const ClientStats& c : stats.clients) {
    double h2d = 0, d2h = 0;
    auto it = before.find(c.client);
    if (it != before.end() && interval_s > 0) {
      h2d = static_cast<double>(c.bytes_host_to_gpu - it->second->bytes_host_to_gpu) / interval_s;
      d2h = static_cast<double>(c.bytes_gpu_to_host - it->second->bytes_gpu_to_host) / interval_s;
    }
    char line[320];
    std::snprintf(line, sizeof(line),
                  "%6u %-16.16s %7d %6" PRId64 " %6" PRId64 " %8" PRIu64 " %8" PRIu64 " %8" PRIu64 " %8" PRIu64
                  " %11s %11s %5.1f%% %9" PRIu64 " %10s\n",
                  c.client, c.name.c_str(), c.pid, c.gpu_frames.current, c.host_frames.current, c.pages_gpu,
                  c.pages_host, c.pages_both, c.pages_none, human_bytes(static_cast<uint64_t>(h2d)).c_str(),
                  human_bytes(static_cast<uint64_t>(d2h)).c_str(), 100.0 * hit_rate(c), c.evictions,
                  human_duration_ns(c.stall_ns).c_str());
    out << line;
  }
  return out.str();
}

}  // namespace membar::ctl
