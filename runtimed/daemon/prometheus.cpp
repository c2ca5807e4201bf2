#include "prometheus.h"

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

std::string format_prometheus(const RuntimeStats& stats) {
  std::ostringstream out;
  family(out, "membar_info", "gauge", "Backend of this membard (label backend).");
  out << "membar_info{backend=\"" << escape_label(stats.backend) << "\"} 1\n";

  family(out, "membar_frames_total", "gauge", "Frames (2 MiB) in the tier's pool.");
  for (const TierStats& t : stats.tiers) out << "membar_frames_total{tier=\"" << tier_label(t.tier) << "\"} " << t.frames_total << '\n';
  family(out, "membar_frames_used", "gauge", "Frames held by clients.");
  for (const TierStats& t : stats.tiers) out << "membar_frames_used{tier=\"" << tier_label(t.tier) << "\"} " << t.frames_used << '\n';
  family(out, "membar_frames_free", "gauge", "Frames free in the pool.");
  for (const TierStats& t : stats.tiers) out << "membar_frames_free{tier=\"" << tier_label(t.tier) << "\"} " << t.frames_free << '\n';
  family(out, "membar_frames_preparing", "gauge", "Frames being cleared or pinned before reuse.");
  for (const TierStats& t : stats.tiers) {
    out << "membar_frames_preparing{tier=\"" << tier_label(t.tier) << "\"} " << t.frames_preparing << '\n';
  }

  family(out, "membar_clients", "gauge", "Connected clients.");
  out << "membar_clients " << stats.clients.size() << '\n';

  auto labels = [](const ClientStats& c) {
    return "client=\"" + std::to_string(c.client) + "\",name=\"" + escape_label(c.name) + "\",pid=\"" +
           std::to_string(c.pid) + "\"";
  };
  family(out, "membar_client_frames", "gauge", "Frames a client holds, per tier.");
  for (const ClientStats& c : stats.clients) {
    out << "membar_client_frames{" << labels(c) << ",tier=\"gpu\"} " << c.gpu_frames.current << '\n';
    out << "membar_client_frames{" << labels(c) << ",tier=\"host\"} " << c.host_frames.current << '\n';
  }
  family(out, "membar_client_bytes", "gauge", "A client's space bytes by residency.");
  for (const ClientStats& c : stats.clients) {
    out << "membar_client_bytes{" << labels(c) << ",residency=\"gpu\"} " << c.bytes_gpu << '\n';
    out << "membar_client_bytes{" << labels(c) << ",residency=\"host\"} " << c.bytes_host << '\n';
    out << "membar_client_bytes{" << labels(c) << ",residency=\"both\"} " << c.bytes_both << '\n';
    out << "membar_client_bytes{" << labels(c) << ",residency=\"none\"} " << c.bytes_none << '\n';
  }
  family(out, "membar_client_channel_bytes", "gauge", "Bytes of a client's channels (in its host quota).");
  for (const ClientStats& c : stats.clients) out << "membar_client_channel_bytes{" << labels(c) << "} " << c.channel_bytes << '\n';
  family(out, "membar_client_transferred_bytes_total", "counter", "Bytes moved between tiers.");
  for (const ClientStats& c : stats.clients) {
    out << "membar_client_transferred_bytes_total{" << labels(c) << ",direction=\"host_to_gpu\"} " << c.bytes_host_to_gpu << '\n';
    out << "membar_client_transferred_bytes_total{" << labels(c) << ",direction=\"gpu_to_host\"} " << c.bytes_gpu_to_host << '\n';
  }
  family(out, "membar_client_prefetch_hits_total", "counter", "Acquires that found the frame already on the GPU.");
  for (const ClientStats& c : stats.clients) out << "membar_client_prefetch_hits_total{" << labels(c) << "} " << c.prefetch_hits << '\n';
  family(out, "membar_client_prefetch_misses_total", "counter", "Acquires that had to start a transfer.");
  for (const ClientStats& c : stats.clients) out << "membar_client_prefetch_misses_total{" << labels(c) << "} " << c.prefetch_misses << '\n';
  family(out, "membar_client_evictions_total", "counter", "Space frames evicted from the GPU tier.");
  for (const ClientStats& c : stats.clients) out << "membar_client_evictions_total{" << labels(c) << "} " << c.evictions << '\n';
  family(out, "membar_client_stall_seconds_total", "counter", "Time the client waited for pages.");
  for (const ClientStats& c : stats.clients) {
    out << "membar_client_stall_seconds_total{" << labels(c) << "} " << static_cast<double>(c.stall_ns) * 1e-9 << '\n';
  }
  family(out, "membar_space_bytes", "gauge", "A space's bytes by residency (and dirty, pinned).");
  for (const SpaceInfo& s : stats.spaces) {
    std::string space_labels = "client=\"" + std::to_string(s.client) + "\",space=\"" + escape_label(s.name) + "\"";
    for (auto [state, count] : {std::pair<const char*, uint64_t>{"gpu", s.bytes_gpu}, {"host", s.bytes_host},
                                {"both", s.bytes_both}, {"none", s.bytes_none}, {"dirty", s.bytes_dirty},
                                {"pinned", s.bytes_pinned}}) {
      out << "membar_space_bytes{" << space_labels << ",state=\"" << state << "\"} " << count << '\n';
    }
  }
  return out.str();
}

}  // namespace membar::runtimed
