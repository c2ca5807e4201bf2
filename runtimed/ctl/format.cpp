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

std::string device_list(const std::vector<DeviceRuntimeStats>& devices) {
  std::string text;
  for (const DeviceRuntimeStats& d : devices) text += (text.empty() ? "" : ", ") + std::to_string(d.device);
  return text;
}

size_t client_count(const std::vector<DeviceRuntimeStats>& devices) {
  size_t count = 0;
  for (const DeviceRuntimeStats& d : devices) count += d.stats.clients.size();
  return count;
}

uint64_t spaces_total(const std::vector<DeviceRuntimeStats>& devices) {
  uint64_t count = 0;
  for (const DeviceRuntimeStats& d : devices) count += d.stats.spaces_total;
  return count;
}

std::string backend_of(const std::vector<DeviceRuntimeStats>& devices) {
  return devices.empty() ? std::string() : devices.front().stats.backend;
}

std::string json_tiers(const RuntimeStats& stats, const std::string& indent) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < stats.tiers.size(); ++i) {
    const TierStats& t = stats.tiers[i];
    out << (i ? "," : "") << "\n" << indent << "  {\"tier\": \"" << tier_name(t.tier) << "\", \"frames_total\": "
        << t.frames_total << ", \"frames_used\": " << t.frames_used << ", \"frames_free\": " << t.frames_free
        << ", \"frames_preparing\": " << t.frames_preparing << ", \"frames_lost\": " << t.frames_lost
        << ", \"frames_on_request\": " << t.frames_on_request
        << ", \"frame_bytes\": " << kFrameBytes
        << ", \"numa_node\": " << (t.numa_node >= 0 ? std::to_string(t.numa_node) : std::string("null")) << "}";
  }
  out << "\n" << indent << "]";
  return out.str();
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

std::string format_stats_text(const std::vector<DeviceRuntimeStats>& devices, const std::string& socket_path) {
  std::ostringstream out;
  out << "# Server\n";
  out << "socket: " << socket_path << '\n';
  out << "backend: " << backend_of(devices) << '\n';
  out << "devices: " << device_list(devices) << '\n';
  out << "clients: " << client_count(devices) << '\n';
  out << "spaces: " << spaces_total(devices) << '\n';
  for (const DeviceRuntimeStats& d : devices) {
    const RuntimeStats& stats = d.stats;
    for (const TierStats& t : stats.tiers) {
      out << "\n# Tier " << tier_name(t.tier) << " (device " << d.device << ")\n";
      out << "device: " << d.device << '\n';
      out << "frames_total: " << frames_field(static_cast<int64_t>(t.frames_total)) << '\n';
      out << "frames_used: " << frames_field(static_cast<int64_t>(t.frames_used)) << '\n';
      out << "frames_free: " << frames_field(static_cast<int64_t>(t.frames_free)) << '\n';
      out << "frames_preparing: " << frames_field(static_cast<int64_t>(t.frames_preparing)) << '\n';
      if (t.frames_lost != 0) {   // renewals that failed for good (membard's log says why)
        out << "frames_lost: " << frames_field(static_cast<int64_t>(t.frames_lost)) << '\n';
      }
      if (t.frames_on_request != 0) {   // the node's host pool, held by no device or free on another
        out << "frames_on_request: " << frames_field(static_cast<int64_t>(t.frames_on_request)) << '\n';
      }
      if (t.tier == Tier::kHost) {
        out << "numa_node: " << (t.numa_node >= 0 ? std::to_string(t.numa_node) : std::string("none (placed by the kernel)"))
            << '\n';
      }
    }
    for (const ClientStats& c : stats.clients) {
      out << "\n# Client " << c.client << '\n';
      out << "device: " << d.device << '\n';
      out << "name: " << c.name << '\n';
      out << "pid: " << c.pid << '\n';
      out << "uid: " << c.uid << '\n';
      out << "gpu_quota: " << bytes_field(c.gpu_quota_bytes) << '\n';
      out << "host_quota: " << bytes_field(c.host_quota_bytes) << '\n';
      out << "gpu_frames: " << frames_field(c.gpu_frames.current) << '\n';
      out << "gpu_frames_peak: " << frames_field(c.gpu_frames.peak) << '\n';
      out << "host_frames: " << frames_field(c.host_frames.current) << '\n';
      out << "host_frames_peak: " << frames_field(c.host_frames.peak) << '\n';
      out << "spaces: " << c.spaces << '\n';
      out << "bytes_gpu: " << bytes_field(c.bytes_gpu) << '\n';
      out << "bytes_host: " << bytes_field(c.bytes_host) << '\n';
      out << "bytes_both: " << bytes_field(c.bytes_both) << '\n';
      out << "bytes_none: " << bytes_field(c.bytes_none) << '\n';
      out << "channel_bytes: " << bytes_field(c.channel_bytes) << '\n';
      out << "bytes_host_to_gpu: " << bytes_field(c.bytes_host_to_gpu) << '\n';
      out << "bytes_gpu_to_host: " << bytes_field(c.bytes_gpu_to_host) << '\n';
      out << "prefetch_hits: " << c.prefetch_hits << '\n';
      out << "prefetch_misses: " << c.prefetch_misses << '\n';
      char rate[32];
      std::snprintf(rate, sizeof(rate), "%.4f (%.1f%%)", hit_rate(c), 100.0 * hit_rate(c));
      out << "prefetch_hit_rate: " << rate << '\n';
      out << "evictions: " << c.evictions << '\n';
      out << "gpu_maps: " << c.gpu_maps << '\n';
      out << "gpu_unmaps: " << c.gpu_unmaps << '\n';
      out << "fence_waits: " << c.fence_waits << " (" << human_duration_ns(c.fence_wait_ns) << ")\n";
      out << "call_time: lock wait " << human_duration_ns(c.call_lock_wait_ns) << ", locked "
          << human_duration_ns(c.call_locked_ns) << " (enqueue " << human_duration_ns(c.call_enqueue_ns)
          << "), deliver " << human_duration_ns(c.call_deliver_ns) << '\n';
      out << "stall_ns: " << c.stall_ns << " (" << human_duration_ns(c.stall_ns) << ")\n";
    }
    for (const SpaceInfo& s : stats.spaces) {
      out << "\n# Space " << s.client << "." << s.id << '\n';
      out << "device: " << d.device << '\n';
      out << "name: " << s.name << '\n';
      out << "client: " << s.client << '\n';
      out << "page_bytes: " << bytes_field(s.page_bytes) << '\n';
      out << "page_count: " << s.page_count << '\n';
      out << "bytes: " << bytes_field(s.page_bytes * s.page_count) << '\n';
      out << "bytes_gpu: " << bytes_field(s.bytes_gpu) << '\n';
      out << "bytes_host: " << bytes_field(s.bytes_host) << '\n';
      out << "bytes_both: " << bytes_field(s.bytes_both) << '\n';
      out << "bytes_none: " << bytes_field(s.bytes_none) << '\n';
      out << "bytes_dirty: " << bytes_field(s.bytes_dirty) << '\n';
      out << "bytes_pinned: " << bytes_field(s.bytes_pinned) << '\n';
      out << "bytes_host_to_gpu: " << bytes_field(s.bytes_host_to_gpu) << '\n';
      out << "bytes_gpu_to_host: " << bytes_field(s.bytes_gpu_to_host) << '\n';
    }
  }
  return out.str();
}

std::string format_stats_json(const std::vector<DeviceRuntimeStats>& devices, const std::string& socket_path) {
  static const RuntimeStats kNone;
  const RuntimeStats& first = devices.empty() ? kNone : devices.front().stats;
  std::ostringstream out;
  out << "{\n  \"socket\": " << json_string(socket_path) << ",\n  \"backend\": " << json_string(backend_of(devices))
      << ",\n  \"spaces_total\": " << spaces_total(devices) << ",\n  \"tiers\": " << json_tiers(first, "  ");
  out << ",\n  \"devices\": [";
  for (size_t i = 0; i < devices.size(); ++i) {
    const DeviceRuntimeStats& d = devices[i];
    out << (i ? "," : "") << "\n    {\"device\": " << d.device << ", \"spaces_total\": " << d.stats.spaces_total
        << ", \"clients\": [";
    for (size_t c = 0; c < d.stats.clients.size(); ++c) out << (c ? ", " : "") << d.stats.clients[c].client;
    out << "], \"tiers\": " << json_tiers(d.stats, "    ") << "}";
  }
  out << "\n  ],\n  \"clients\": [";
  bool first_entry = true;
  for (const DeviceRuntimeStats& d : devices) {
    for (const ClientStats& c : d.stats.clients) {
      out << (first_entry ? "" : ",") << "\n    {\"client\": " << c.client << ", \"device\": " << d.device
          << ", \"name\": " << json_string(c.name) << ", \"pid\": " << c.pid << ", \"uid\": " << c.uid
          << ", \"gpu_quota_bytes\": " << c.gpu_quota_bytes << ", \"host_quota_bytes\": " << c.host_quota_bytes
          << ", \"gpu_frames\": " << json_stat(c.gpu_frames) << ", \"host_frames\": " << json_stat(c.host_frames)
          << ", \"spaces\": " << c.spaces << ", \"bytes_gpu\": " << c.bytes_gpu << ", \"bytes_host\": " << c.bytes_host
          << ", \"bytes_both\": " << c.bytes_both << ", \"bytes_none\": " << c.bytes_none
          << ", \"channel_bytes\": " << c.channel_bytes << ", \"bytes_host_to_gpu\": " << c.bytes_host_to_gpu
          << ", \"bytes_gpu_to_host\": " << c.bytes_gpu_to_host << ", \"prefetch_hits\": " << c.prefetch_hits
          << ", \"prefetch_misses\": " << c.prefetch_misses << ", \"prefetch_hit_rate\": " << hit_rate(c)
          << ", \"evictions\": " << c.evictions << ", \"stall_ns\": " << c.stall_ns
          << ", \"gpu_maps\": " << c.gpu_maps << ", \"gpu_unmaps\": " << c.gpu_unmaps
          << ", \"fence_waits\": " << c.fence_waits << ", \"fence_wait_ns\": " << c.fence_wait_ns
          << ", \"call_lock_wait_ns\": " << c.call_lock_wait_ns << ", \"call_locked_ns\": " << c.call_locked_ns
          << ", \"call_enqueue_ns\": " << c.call_enqueue_ns << ", \"call_deliver_ns\": " << c.call_deliver_ns << "}";
      first_entry = false;
    }
  }
  out << "\n  ],\n  \"spaces\": [";
  first_entry = true;
  for (const DeviceRuntimeStats& d : devices) {
    for (const SpaceInfo& s : d.stats.spaces) {
      out << (first_entry ? "" : ",") << "\n    {\"id\": " << s.id << ", \"name\": " << json_string(s.name)
          << ", \"client\": " << s.client << ", \"device\": " << d.device << ", \"page_bytes\": " << s.page_bytes
          << ", \"page_count\": " << s.page_count << ", \"bytes_gpu\": " << s.bytes_gpu << ", \"bytes_host\": "
          << s.bytes_host << ", \"bytes_both\": " << s.bytes_both << ", \"bytes_none\": " << s.bytes_none
          << ", \"bytes_dirty\": " << s.bytes_dirty << ", \"bytes_pinned\": " << s.bytes_pinned
          << ", \"bytes_host_to_gpu\": " << s.bytes_host_to_gpu << ", \"bytes_gpu_to_host\": " << s.bytes_gpu_to_host
          << "}";
      first_entry = false;
    }
  }
  out << "\n  ]\n}\n";
  return out.str();
}

std::string format_top(const std::vector<DeviceRuntimeStats>& devices, const std::vector<DeviceRuntimeStats>& previous,
                       double interval_s, const std::string& socket_path) {
  // Client ids are unique across a daemon's devices.
  std::map<ClientId, const ClientStats*> before;
  std::map<std::pair<ClientId, SpaceId>, const SpaceInfo*> spaces_before;
  for (const DeviceRuntimeStats& d : previous) {
    for (const ClientStats& c : d.stats.clients) before[c.client] = &c;
    for (const SpaceInfo& s : d.stats.spaces) spaces_before[{s.client, s.id}] = &s;
  }
  auto rate = [interval_s](uint64_t now, uint64_t then) {
    return interval_s > 0 && now >= then ? static_cast<double>(now - then) / interval_s : 0.0;
  };
  std::ostringstream out;
  out << "membard " << socket_path << "  backend " << backend_of(devices) << "  devices " << device_list(devices)
      << "  clients " << client_count(devices) << "  (q quits)\n";
  for (const DeviceRuntimeStats& d : devices) {
    for (const TierStats& t : d.stats.tiers) {
      char line[200];
      double used =
          t.frames_total ? 100.0 * static_cast<double>(t.frames_used) / static_cast<double>(t.frames_total) : 0;
      std::snprintf(line, sizeof(line), "dev %-2d %-4s %9s used of %9s (%5.1f%%), %9s free, %9s being prepared\n",
                    d.device, tier_name(t.tier), human_bytes(t.frames_used * kFrameBytes).c_str(),
                    human_bytes(t.frames_total * kFrameBytes).c_str(), used,
                    human_bytes(t.frames_free * kFrameBytes).c_str(),
                    human_bytes(t.frames_preparing * kFrameBytes).c_str());
      out << line;
      if (t.frames_lost != 0) {
        out << "       " << human_bytes(t.frames_lost * kFrameBytes) << " lost: renewals failed (see membard's log)\n";
      }
      if (t.frames_on_request != 0) {
        out << "       " << human_bytes(t.frames_on_request * kFrameBytes) << " more on request from the node's host pool\n";
      }
    }
  }
  char header[256];
  std::snprintf(header, sizeof(header), "\n%6s %3s %-20s %7s %9s %9s %10s %10s %6s %8s %7s\n", "CLIENT", "DEV", "NAME",
                "PID", "GPU", "HOST", "IN/s", "OUT/s", "HIT%", "EVICT/s", "STALL%");
  out << header;
  for (const DeviceRuntimeStats& d : devices) {
    for (const ClientStats& c : d.stats.clients) {
      auto it = before.find(c.client);
      double in = 0, back = 0, evictions = 0, stall = 0;
      if (it != before.end()) {
        in = rate(c.bytes_host_to_gpu, it->second->bytes_host_to_gpu);
        back = rate(c.bytes_gpu_to_host, it->second->bytes_gpu_to_host);
        evictions = rate(c.evictions, it->second->evictions);
        stall = rate(c.stall_ns, it->second->stall_ns) / 1e9;  // seconds stalled per second
      }
      char line[320];
      std::snprintf(line, sizeof(line), "%6u %3d %-20.20s %7d %9s %9s %10s %10s %5.1f%% %8.0f %6.2f%%\n", c.client,
                    d.device, c.name.c_str(), c.pid, human_bytes(c.gpu_frames.current * kFrameBytes).c_str(),
                    human_bytes(c.host_frames.current * kFrameBytes).c_str(), human_bytes(uint64_t(in)).c_str(),
                    human_bytes(uint64_t(back)).c_str(), 100.0 * hit_rate(c), evictions, 100.0 * stall);
      out << line;
    }
  }
  std::vector<std::pair<int, const SpaceInfo*>> spaces;
  for (const DeviceRuntimeStats& d : devices) {
    for (const SpaceInfo& s : d.stats.spaces) spaces.push_back({d.device, &s});
  }
  if (!spaces.empty()) {
    char space_header[200];
    std::snprintf(space_header, sizeof(space_header), "\n%6s %3s %-24s %10s %10s %10s %10s %10s\n", "CLIENT", "DEV",
                  "SPACE", "SIZE", "ON GPU", "ON HOST", "IN/s", "OUT/s");
    out << space_header;
    size_t shown = 0;
    for (auto [device, space] : spaces) {
      const SpaceInfo& s = *space;
      if (++shown > 40) {
        out << "  ... " << (spaces.size() - 40) << " more spaces (membarctl stats lists them all)\n";
        break;
      }
      auto it = spaces_before.find({s.client, s.id});
      double in = it == spaces_before.end() ? 0 : rate(s.bytes_host_to_gpu, it->second->bytes_host_to_gpu);
      double back = it == spaces_before.end() ? 0 : rate(s.bytes_gpu_to_host, it->second->bytes_gpu_to_host);
      char line[256];
      std::snprintf(line, sizeof(line), "%6u %3d %-24.24s %10s %10s %10s %10s %10s\n", s.client, device, s.name.c_str(),
                    human_bytes(s.page_bytes * s.page_count).c_str(), human_bytes(s.bytes_gpu + s.bytes_both).c_str(),
                    human_bytes(s.bytes_host + s.bytes_both).c_str(), human_bytes(uint64_t(in)).c_str(),
                    human_bytes(uint64_t(back)).c_str());
      out << line;
    }
  }
  out << "\nGPU/HOST: memory the client holds in each pool; IN/s, OUT/s: bytes copied to / from the GPU per\n"
         "second; HIT%: acquires that found their pages already on the GPU (prefetched); EVICT/s: 2 MiB\n"
         "frames evicted per second; STALL%: time the trainer waited for pages, per second of wall time.\n";
  return out.str();
}

}  // namespace membar::ctl
