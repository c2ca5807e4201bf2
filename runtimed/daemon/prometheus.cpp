#include "prometheus.h"

#include <functional>
#include <sstream>

namespace membar::runtimed {
namespace {

const char* tier_label(Tier tier) { return tier == Tier::kGpu ? "gpu" : "host"; }

// Label values escape backslash, quote and newline (exposition format rules).
std::string escape_label(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void family(std::ostringstream& out, const char* name, const char* type, const char* help) {
  out << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n';
}

}  // namespace

std::string format_prometheus(const RuntimeStats& stats) { return format_prometheus({DeviceRuntimeStats{0, stats}}); }

std::string format_prometheus(const std::vector<DeviceRuntimeStats>& devices) {
  std::ostringstream out;
  bool labelled = devices.size() > 1;
  // `device="N",` before a sample's other labels (nothing for one device); `only` for a sample
  // with no other label.
  auto device_label = [labelled](const DeviceRuntimeStats& d) {
    return labelled ? "device=\"" + std::to_string(d.device) + "\"," : std::string();
  };
  auto only_device = [labelled](const DeviceRuntimeStats& d) {
    return labelled ? "{device=\"" + std::to_string(d.device) + "\"}" : std::string();
  };
  std::string backend = devices.empty() ? "" : devices.front().stats.backend;
  family(out, "membar_info", "gauge", "Backend of this membard (label backend).");
  out << "membar_info{backend=\"" << escape_label(backend) << "\"} 1\n";

  struct TierFamily {
    const char* name;
    const char* help;
    uint64_t TierStats::*field;
  };
  for (const TierFamily& f : {TierFamily{"membar_frames_total", "Frames (2 MiB) in the tier's pool.", &TierStats::frames_total},
                              TierFamily{"membar_frames_used", "Frames held by clients.", &TierStats::frames_used},
                              TierFamily{"membar_frames_free", "Frames free in the pool.", &TierStats::frames_free},
                              TierFamily{"membar_frames_preparing", "Frames being cleared or pinned before reuse.",
                                         &TierStats::frames_preparing},
                              TierFamily{"membar_frames_lost", "Frames whose renewal failed for good (out of the pool).",
                                         &TierStats::frames_lost},
                              TierFamily{"membar_frames_on_request",
                                         "Host frames of the node's pool this device would get on request.",
                                         &TierStats::frames_on_request}}) {
    family(out, f.name, "gauge", f.help);
    for (const DeviceRuntimeStats& d : devices) {
      for (const TierStats& t : d.stats.tiers) {
        out << f.name << '{' << device_label(d) << "tier=\"" << tier_label(t.tier) << "\"} " << t.*f.field << '\n';
      }
    }
  }

  family(out, "membar_host_pool_numa_node", "gauge",
         "NUMA node the host pool is bound to (--host-numa-node); -1: placed by the kernel.");
  for (const DeviceRuntimeStats& d : devices) {
    for (const TierStats& t : d.stats.tiers) {
      if (t.tier == Tier::kHost) out << "membar_host_pool_numa_node" << only_device(d) << ' ' << t.numa_node << '\n';
    }
  }

  family(out, "membar_clients", "gauge", "Connected clients.");
  for (const DeviceRuntimeStats& d : devices) out << "membar_clients" << only_device(d) << ' ' << d.stats.clients.size() << '\n';

  // Every client sample, with its device's label.
  auto each_client = [&](const std::function<void(const std::string&, const ClientStats&)>& write) {
    for (const DeviceRuntimeStats& d : devices) {
      for (const ClientStats& c : d.stats.clients) {
        write(device_label(d) + "client=\"" + std::to_string(c.client) + "\",name=\"" + escape_label(c.name) +
                  "\",pid=\"" + std::to_string(c.pid) + "\"",
              c);
      }
    }
  };
  family(out, "membar_client_frames", "gauge", "Frames a client holds, per tier.");
  each_client([&](const std::string& labels, const ClientStats& c) {
    out << "membar_client_frames{" << labels << ",tier=\"gpu\"} " << c.gpu_frames.current << '\n';
    out << "membar_client_frames{" << labels << ",tier=\"host\"} " << c.host_frames.current << '\n';
  });
  family(out, "membar_client_bytes", "gauge", "A client's space bytes by residency.");
  each_client([&](const std::string& labels, const ClientStats& c) {
    out << "membar_client_bytes{" << labels << ",residency=\"gpu\"} " << c.bytes_gpu << '\n';
    out << "membar_client_bytes{" << labels << ",residency=\"host\"} " << c.bytes_host << '\n';
    out << "membar_client_bytes{" << labels << ",residency=\"both\"} " << c.bytes_both << '\n';
    out << "membar_client_bytes{" << labels << ",residency=\"none\"} " << c.bytes_none << '\n';
  });
  family(out, "membar_client_channel_bytes", "gauge", "Bytes of a client's channels (in its host quota).");
  each_client([&](const std::string& labels, const ClientStats& c) {
    out << "membar_client_channel_bytes{" << labels << "} " << c.channel_bytes << '\n';
  });
  family(out, "membar_client_transferred_bytes_total", "counter", "Bytes moved between tiers.");
  each_client([&](const std::string& labels, const ClientStats& c) {
    out << "membar_client_transferred_bytes_total{" << labels << ",direction=\"host_to_gpu\"} " << c.bytes_host_to_gpu << '\n';
    out << "membar_client_transferred_bytes_total{" << labels << ",direction=\"gpu_to_host\"} " << c.bytes_gpu_to_host << '\n';
  });
  family(out, "membar_client_prefetch_hits_total", "counter", "Acquires that found the frame already on the GPU.");
  each_client([&](const std::string& labels, const ClientStats& c) {
    out << "membar_client_prefetch_hits_total{" << labels << "} " << c.prefetch_hits << '\n';
  });
  family(out, "membar_client_prefetch_misses_total", "counter", "Acquires that had to start a transfer.");
  each_client([&](const std::string& labels, const ClientStats& c) {
    out << "membar_client_prefetch_misses_total{" << labels << "} " << c.prefetch_misses << '\n';
  });
  family(out, "membar_client_evictions_total", "counter", "Space frames evicted from the GPU tier.");
  each_client([&](const std::string& labels, const ClientStats& c) {
    out << "membar_client_evictions_total{" << labels << "} " << c.evictions << '\n';
  });
  family(out, "membar_client_stall_seconds_total", "counter", "Time the client waited for pages.");
  each_client([&](const std::string& labels, const ClientStats& c) {
    out << "membar_client_stall_seconds_total{" << labels << "} " << static_cast<double>(c.stall_ns) * 1e-9 << '\n';
  });
  family(out, "membar_space_bytes", "gauge", "A space's bytes by residency (and dirty, pinned).");
  for (const DeviceRuntimeStats& d : devices) {
    for (const SpaceInfo& s : d.stats.spaces) {
      std::string space_labels =
          device_label(d) + "client=\"" + std::to_string(s.client) + "\",space=\"" + escape_label(s.name) + "\"";
      for (auto [state, count] : {std::pair<const char*, uint64_t>{"gpu", s.bytes_gpu}, {"host", s.bytes_host},
                                  {"both", s.bytes_both}, {"none", s.bytes_none}, {"dirty", s.bytes_dirty},
                                  {"pinned", s.bytes_pinned}}) {
        out << "membar_space_bytes{" << space_labels << ",state=\"" << state << "\"} " << count << '\n';
      }
    }
  }
  return out.str();
}

}  // namespace membar::runtimed
