// The runtime as a TorchScript custom class, torch.classes.membar.Runtime: a membar::Client
// (from connect(): a daemon, or the embedded runtime) with its calls translated to torch types.
// Bindings only validate and translate; every Status that is not OK becomes a RuntimeError whose
// message is the Status's sentence. The friendly Python API is membar/runtime.py.
//
// Pools: pool(space, dtype, page_shape) views a space's GPU-side addresses as
//   [page_count, *page_shape]   (dtype; CUDA on the CUDA backend, CPU on the host one)
// so page p of the space is pool[p] (Note [Space layout] in engine/engine.cpp). The tensor is made
// with at::from_blob over the space's base; its deleter frees nothing and only holds a reference
// to this Runtime, so the space's reservation (and the client that owns it) outlives every tensor
// that views it. Only rows of pages that are acquired (and not yet released) may be touched:
// other rows may be unmapped (reading them faults) or hold stale contents.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdio>
#include <map>
#include <optional>

#include "membar/client.h"

namespace membar::bindings {
namespace {

void check_ok(const Status& status, const char* what) {
  TORCH_CHECK(status.ok(), "membar runtime ", what, ": ", status.to_string());
}

template <typename T>
T take(Result<T> result, const char* what) {
  check_ok(result.status(), what);
  return std::move(result).value();
}

uint32_t to_u32(int64_t value, const char* name) {
  TORCH_CHECK(value >= 0 && value <= int64_t(UINT32_MAX), "membar runtime: ", name,
              " must be in [0, 2^32), got ", value, ".");
  return uint32_t(value);
}

PageRange make_range(int64_t space, int64_t first, int64_t count) {
  return PageRange{to_u32(space, "space"), to_u32(first, "first page"), to_u32(count, "page count")};
}

std::vector<PageRange> make_ranges(const std::vector<int64_t>& flat, const char* what) {
  TORCH_CHECK(!flat.empty() && flat.size() % 3 == 0, "membar runtime ", what,
              ": ranges must be a flat list of (space, first, count) triples, got ", flat.size(), " numbers.");
  std::vector<PageRange> ranges;
  for (size_t i = 0; i < flat.size(); i += 3) ranges.push_back(make_range(flat[i], flat[i + 1], flat[i + 2]));
  return ranges;
}

std::string json_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buffer[8];
          std::snprintf(buffer, sizeof(buffer), "\\u%04x", c);
          out += buffer;
        } else {
          out += c;
        }
    }
  }
  return out;
}

// Plain string building (no iostreams needed for a flat JSON object).
void append_number(std::string& out, uint64_t value) { out += std::to_string(value); }
void append_number(std::string& out, int64_t value) { out += std::to_string(value); }

void append_field(std::string& out, const char* name, uint64_t value, bool comma = true) {
  if (comma) out += ", ";
  out += "\"";
  out += name;
  out += "\": ";
  append_number(out, value);
}

void write_stat(std::string& out, const char* name, const Stat& stat) {
  out += "\"";
  out += name;
  out += "\": {\"current\": ";
  append_number(out, int64_t(stat.current));
  out += ", \"peak\": ";
  append_number(out, int64_t(stat.peak));
  out += ", \"allocated\": ";
  append_number(out, int64_t(stat.allocated));
  out += ", \"freed\": ";
  append_number(out, int64_t(stat.freed));
  out += "}";
}

std::string stats_json(const RuntimeStats& stats) {
  std::string out = "{\"backend\": \"" + json_escape(stats.backend) + "\", \"tiers\": [";
  for (size_t i = 0; i < stats.tiers.size(); ++i) {
    const TierStats& tier = stats.tiers[i];
    out += i ? ", " : "";
    out += "{\"tier\": \"";
    out += tier.tier == Tier::kGpu ? "gpu" : "host";
    out += "\"";
    append_field(out, "frames_total", tier.frames_total);
    append_field(out, "frames_used", tier.frames_used);
    append_field(out, "frames_free", tier.frames_free);
    append_field(out, "frames_preparing", tier.frames_preparing);
    append_field(out, "frames_lost", tier.frames_lost);
    append_field(out, "frames_on_request", tier.frames_on_request);
    out += ", \"numa_node\": ";
    append_number(out, int64_t(tier.numa_node));
    out += "}";
  }
  out += "], \"clients\": [";
  for (size_t i = 0; i < stats.clients.size(); ++i) {
    const ClientStats& c = stats.clients[i];
    out += i ? ", " : "";
    out += "{";
    append_field(out, "client", c.client, /*comma=*/false);
    out += ", \"pid\": ";
    append_number(out, int64_t(c.pid));
    out += ", \"name\": \"" + json_escape(c.name) + "\"";
    append_field(out, "gpu_quota_bytes", c.gpu_quota_bytes);
    append_field(out, "host_quota_bytes", c.host_quota_bytes);
    out += ", ";
    write_stat(out, "gpu_frames", c.gpu_frames);
    out += ", ";
    write_stat(out, "host_frames", c.host_frames);
    append_field(out, "spaces", c.spaces);
    append_field(out, "bytes_gpu", c.bytes_gpu);
    append_field(out, "bytes_host", c.bytes_host);
    append_field(out, "bytes_both", c.bytes_both);
    append_field(out, "bytes_none", c.bytes_none);
    append_field(out, "channel_bytes", c.channel_bytes);
    append_field(out, "bytes_host_to_gpu", c.bytes_host_to_gpu);
    append_field(out, "bytes_gpu_to_host", c.bytes_gpu_to_host);
    append_field(out, "prefetch_hits", c.prefetch_hits);
    append_field(out, "prefetch_misses", c.prefetch_misses);
    append_field(out, "evictions", c.evictions);
    append_field(out, "stall_ns", c.stall_ns);
    append_field(out, "gpu_maps", c.gpu_maps);
    append_field(out, "gpu_unmaps", c.gpu_unmaps);
    append_field(out, "fence_waits", c.fence_waits);
    append_field(out, "fence_wait_ns", c.fence_wait_ns);
    append_field(out, "call_lock_wait_ns", c.call_lock_wait_ns);
    append_field(out, "call_locked_ns", c.call_locked_ns);
    append_field(out, "call_enqueue_ns", c.call_enqueue_ns);
    append_field(out, "call_deliver_ns", c.call_deliver_ns);
    out += "}";
  }
  out += "], \"spaces\": [";
  for (size_t i = 0; i < stats.spaces.size(); ++i) {
    const SpaceInfo& space = stats.spaces[i];
    out += i ? ", " : "";
    out += "{";
    append_field(out, "id", space.id, /*comma=*/false);
    out += ", \"name\": \"" + json_escape(space.name) + "\"";
    append_field(out, "page_bytes", space.page_bytes);
    append_field(out, "page_count", space.page_count);
    append_field(out, "client", space.client);
    append_field(out, "bytes_gpu", space.bytes_gpu);
    append_field(out, "bytes_host", space.bytes_host);
    append_field(out, "bytes_both", space.bytes_both);
    append_field(out, "bytes_none", space.bytes_none);
    append_field(out, "bytes_dirty", space.bytes_dirty);
    append_field(out, "bytes_pinned", space.bytes_pinned);
    append_field(out, "bytes_host_to_gpu", space.bytes_host_to_gpu);
    append_field(out, "bytes_gpu_to_host", space.bytes_gpu_to_host);
    out += "}";
  }
  out += "]}";
  return out;
}

class Runtime : public torch::CustomClassHolder {
 public:
  // socket: "" = connect()'s usual order ($MEMBAR_SOCKET, default socket, embedded);
  // "embedded" = always the embedded runtime; anything else = that daemon socket.
  // backend: "auto", "host" or "cuda" (embedded mode). device: -1 = the daemon's first device
  // (embedded: 0); else the device asked of the daemon, or the embedded runtime's.
  static c10::intrusive_ptr<Runtime> connect(std::string socket, bool allow_embedded, std::string backend,
                                             int64_t gpu_pool_bytes, int64_t host_pool_bytes, int64_t device,
                                             std::string name, int64_t gpu_quota_bytes, int64_t host_quota_bytes) {
    ConnectOptions options;
    options.allow_embedded = allow_embedded;
    options.client_name = std::move(name);
    TORCH_CHECK(gpu_pool_bytes >= 0 && host_pool_bytes >= 0 && gpu_quota_bytes >= 0 && host_quota_bytes >= 0,
                "membar runtime connect: pool and quota sizes must not be negative.");
    TORCH_CHECK(device >= -1, "membar runtime connect: device must not be negative, got ", device, ".");
    options.gpu_quota_bytes = uint64_t(gpu_quota_bytes);
    options.host_quota_bytes = uint64_t(host_quota_bytes);
    options.embedded.gpu_pool_bytes = uint64_t(gpu_pool_bytes);
    options.embedded.host_pool_bytes = uint64_t(host_pool_bytes);
    options.embedded.device = device < 0 ? 0 : int(device);
    if (device >= 0) options.device = int(device);
    if (backend == "auto") {
      options.embedded.backend = BackendKind::kAuto;
    } else if (backend == "host") {
      options.embedded.backend = BackendKind::kHost;
    } else if (backend == "cuda") {
      options.embedded.backend = BackendKind::kCuda;
    } else {
      TORCH_CHECK(false, "membar runtime connect: backend must be 'auto', 'host' or 'cuda', not '", backend, "'.");
    }
    auto runtime = c10::make_intrusive<Runtime>();
    if (socket == "embedded") {
      runtime->client_ = take(make_embedded_client(options.embedded), "connect (embedded)");
    } else {
      options.socket_path = socket;
      runtime->client_ = take(membar::connect(options), "connect");
    }
    runtime->device_ = runtime->client_->device();  // the daemon's answer when device was -1
    return runtime;
  }

  std::string describe() const { return client_->describe(); }
  bool stream_waits_preferred() const { return client_->stream_waits_preferred(); }
  std::string backend() const { return client_->backend() == BackendKind::kCuda ? "cuda" : "host"; }
  int64_t device() const { return device_; }

  int64_t create_space(std::string name, int64_t page_bytes, int64_t page_count) {
    TORCH_CHECK(page_bytes > 0, "membar runtime create_space: page_bytes must be positive, got ", page_bytes, ".");
    return take(client_->create_space(name, uint64_t(page_bytes), to_u32(page_count, "page_count")), "create_space");
  }

  void destroy_space(int64_t space) { check_ok(client_->destroy_space(to_u32(space, "space")), "destroy_space"); }

  // Returns the ticket: wait(ticket) (or stream_wait) before touching the pages, which are rows
  // [first, first + count) of the space's pool.
  int64_t acquire(int64_t space, int64_t first, int64_t count, bool write, bool zero_new) {
    uint32_t flags = (write ? uint32_t(kAcquireWrite) : 0u) | (zero_new ? uint32_t(kAcquireZeroNew) : 0u);
    return int64_t(take(client_->acquire(make_range(space, first, count), flags), "acquire").ticket);
  }

  // ranges: a flat list of (space, first, count) triples. advance < 0: no schedule step.
  int64_t acquire_ranges(std::vector<int64_t> ranges, bool write, bool zero_new, int64_t advance) {
    uint32_t flags = (write ? uint32_t(kAcquireWrite) : 0u) | (zero_new ? uint32_t(kAcquireZeroNew) : 0u);
    std::optional<uint32_t> step;
    if (advance >= 0) step = to_u32(advance, "advance step");
    return int64_t(take(client_->acquire_ranges(make_ranges(ranges, "acquire_ranges"), flags, step), "acquire_ranges"));
  }

  // pairs: a flat list of (space, first, count) triples, source then destination (Note [Copied
  // pages]); after_marker > 0: the copies wait for that stream_mark / stream_release marker.
  int64_t copy_pages(std::vector<int64_t> pairs, int64_t after_marker) {
    TORCH_CHECK(after_marker >= 0, "membar runtime copy_pages: after_marker must be >= 0 (0: none), got ",
                after_marker, ".");
    std::optional<uint64_t> marker;
    if (after_marker > 0) marker = uint64_t(after_marker);
    return int64_t(take(client_->copy_pages(make_ranges(pairs, "copy_pages"), marker), "copy_pages"));
  }

  // Enqueues a release marker on the stream and returns it (Client::stream_mark).
  int64_t stream_mark(int64_t cuda_stream) {
    return int64_t(take(client_->stream_mark(reinterpret_cast<void*>(cuda_stream)), "stream_mark"));
  }

  void release_ranges(std::vector<int64_t> ranges, bool dirty) {
    check_ok(client_->release_ranges(make_ranges(ranges, "release_ranges"), dirty), "release_ranges");
  }

  void stream_release_ranges(std::vector<int64_t> ranges, bool dirty, int64_t cuda_stream) {
    check_ok(client_->stream_release_ranges(make_ranges(ranges, "stream_release_ranges"), dirty,
                                            reinterpret_cast<void*>(cuda_stream)),
             "stream_release_ranges");
  }

  void release(int64_t space, int64_t first, int64_t count, bool dirty) {
    check_ok(client_->release(make_range(space, first, count), dirty), "release");
  }

  int64_t prefetch(int64_t space, int64_t first, int64_t count) {
    return int64_t(take(client_->prefetch(make_range(space, first, count)), "prefetch"));
  }

  // ranges: a flat list of (space, first, count) triples, prefetched in one call (a hint).
  int64_t prefetch_ranges(std::vector<int64_t> ranges) {
    return int64_t(take(client_->prefetch_ranges(make_ranges(ranges, "prefetch_ranges")), "prefetch_ranges"));
  }

  int64_t offload(int64_t space, int64_t first, int64_t count) {
    return int64_t(take(client_->offload(make_range(space, first, count)), "offload"));
  }

  void free_pages(int64_t space, int64_t first, int64_t count) {
    check_ok(client_->free_pages(make_range(space, first, count)), "free_pages");
  }

  // A CPU uint8 view [count, page_bytes] of the pages' host copies, valid until release_host
  // (blocks until the data is there). Like pools, it holds a reference to this Runtime.
  at::Tensor acquire_host(int64_t space, int64_t first, int64_t count) {
    void* pointer = take(client_->acquire_host(make_range(space, first, count)), "acquire_host");
    SpaceView view = take(client_->space_view(to_u32(space, "space")), "acquire_host");
    c10::intrusive_ptr<Runtime> self = c10::intrusive_ptr<Runtime>::reclaim_copy(this);
    return at::from_blob(pointer, {count, int64_t(view.page_bytes)}, [self](void*) {},
                         at::TensorOptions().dtype(at::kByte));
  }

  void release_host(int64_t space, int64_t first, int64_t count, bool dirty) {
    check_ok(client_->release_host(make_range(space, first, count), dirty), "release_host");
  }

  // steps[i] is a flat list of (space, first, count) triples: the pages step i touches.
  void set_schedule(std::vector<std::vector<int64_t>> steps) {
    std::vector<ScheduleStep> schedule;
    schedule.reserve(steps.size());
    for (size_t s = 0; s < steps.size(); ++s) {
      TORCH_CHECK(steps[s].size() % 3 == 0, "membar runtime set_schedule: step ", s,
                  " must be a flat list of (space, first, count) triples; it has ", steps[s].size(), " numbers.");
      ScheduleStep step;
      for (size_t i = 0; i < steps[s].size(); i += 3) {
        step.ranges.push_back(make_range(steps[s][i], steps[s][i + 1], steps[s][i + 2]));
      }
      schedule.push_back(std::move(step));
    }
    check_ok(client_->set_schedule(std::move(schedule)), "set_schedule");
  }

  void add_stall_ns(int64_t ns) {
    TORCH_CHECK(ns >= 0, "membar runtime add_stall_ns: a wait must not be negative, got ", ns, ".");
    check_ok(client_->add_stall_ns(uint64_t(ns)), "add_stall_ns");
  }

  void advance(int64_t step) { check_ok(client_->advance(to_u32(step, "step")), "advance"); }

  void wait(int64_t ticket) {
    TORCH_CHECK(ticket >= 0, "membar runtime wait: ticket must not be negative, got ", ticket, ".");
    check_ok(client_->wait(Ticket(ticket)), "wait");
  }
  int64_t completed_ticket() const { return int64_t(client_->completed_ticket()); }

  // cuda_stream: torch.cuda.Stream.cuda_stream (the raw cudaStream_t as an integer; 0 = legacy default).
  void stream_wait(int64_t ticket, int64_t cuda_stream) {
    check_ok(client_->stream_wait(Ticket(ticket), reinterpret_cast<void*>(cuda_stream)), "stream_wait");
  }
  void stream_release(int64_t space, int64_t first, int64_t count, bool dirty, int64_t cuda_stream) {
    check_ok(client_->stream_release(make_range(space, first, count), dirty, reinterpret_cast<void*>(cuda_stream)),
             "stream_release");
  }

  std::string stats() { return stats_json(take(client_->stats(), "stats")); }

  // This process's side of the frame events (Note [Maps off the caller's thread] in
  // libclient/memory.cpp): [events_applied, maps, map_runs, wait_ns, apply_ns, asynchronous].
  std::vector<int64_t> map_counters() const {
    MapCounters c = client_->map_counters();
    return {int64_t(c.events_applied), int64_t(c.maps), int64_t(c.map_runs), int64_t(c.wait_ns), int64_t(c.apply_ns),
            int64_t(c.asynchronous)};
  }

  // Channels (membar/engine/channels.h): [handle, fd, bytes, writable, address]. The client's
  // own mapping (at `address`, valid until close_channel) is what Python views: a published
  // channel can no longer be mapped writable again, not even by its creator.
  std::vector<int64_t> create_channel(std::string name, int64_t bytes) {
    TORCH_CHECK(bytes > 0, "membar runtime create_channel: bytes must be positive, got ", bytes, ".");
    return channel_answer(take(client_->create_channel(name, uint64_t(bytes)), "create_channel"));
  }
  std::vector<int64_t> open_channel(std::string name) {
    return channel_answer(take(client_->open_channel(name), "open_channel"));
  }
  void close_channel(int64_t handle) {
    TORCH_CHECK(handle > 0 && handle <= int64_t(UINT32_MAX), "membar runtime close_channel: no channel handle ",
                handle, ".");
    check_ok(client_->close_channel(uint32_t(handle)), "close_channel");
  }

  // The space's base address on the GPU side (tier "gpu") or the host side ("host").
  int64_t space_pointer(int64_t space, std::string tier) {
    SpaceView view = take(client_->space_view(to_u32(space, "space")), "space_pointer");
    TORCH_CHECK(tier == "gpu" || tier == "host", "membar runtime space_pointer: tier is 'gpu' or 'host', not '", tier, "'.");
    return int64_t(reinterpret_cast<uintptr_t>(tier == "gpu" ? view.gpu : view.host));
  }

  // [page_count, *page_shape] over the space's GPU-side addresses; see the header comment.
  at::Tensor pool(int64_t space, at::ScalarType dtype, std::vector<int64_t> page_shape) {
    SpaceView view = take(client_->space_view(to_u32(space, "space")), "pool");
    int64_t elements = 1;
    for (int64_t extent : page_shape) {
      TORCH_CHECK(extent > 0, "membar runtime pool: page_shape extents must be positive, got ", page_shape, ".");
      elements *= extent;
    }
    int64_t element_bytes = int64_t(c10::elementSize(dtype));
    TORCH_CHECK(elements * element_bytes == int64_t(view.page_bytes), "membar runtime pool: page_shape ", page_shape,
                " of ", dtype, " holds ", elements * element_bytes, " bytes, but a page of this space has ",
                view.page_bytes, ".");
    std::vector<int64_t> sizes = {int64_t(view.page_count)};
    sizes.insert(sizes.end(), page_shape.begin(), page_shape.end());
    at::Device device = client_->backend() == BackendKind::kCuda ? at::Device(at::kCUDA, c10::DeviceIndex(device_))
                                                                   : at::Device(at::kCPU);
    c10::intrusive_ptr<Runtime> self = c10::intrusive_ptr<Runtime>::reclaim_copy(this);
    // target_device: the space's first frame may be unmapped, so torch must not ask CUDA which
    // device the base pointer belongs to (it would answer "host memory, not registered").
    return at::for_blob(view.gpu, sizes)
        .deleter([self](void*) {})
        .options(at::TensorOptions().dtype(dtype).device(device))
        .target_device(device)
        .make_tensor();
  }

 private:
  static std::vector<int64_t> channel_answer(const Channel& channel) {
    return {int64_t(channel.handle), int64_t(channel.fd), int64_t(channel.bytes), channel.writable ? 1 : 0,
            int64_t(reinterpret_cast<uintptr_t>(channel.data))};
  }

  std::unique_ptr<Client> client_;
  int device_ = 0;
};

}  // namespace
}  // namespace membar::bindings

TORCH_LIBRARY_FRAGMENT(membar, m) {
  using membar::bindings::Runtime;
  m.class_<Runtime>("Runtime")
      .def_static("connect", &Runtime::connect)
      .def("describe", &Runtime::describe)
      .def("stream_waits_preferred", &Runtime::stream_waits_preferred)
      .def("backend", &Runtime::backend)
      .def("device", &Runtime::device)
      .def("create_space", &Runtime::create_space)
      .def("destroy_space", &Runtime::destroy_space)
      .def("acquire", &Runtime::acquire)
      .def("release", &Runtime::release)
      .def("acquire_ranges", &Runtime::acquire_ranges)
      .def("copy_pages", &Runtime::copy_pages)
      .def("stream_mark", &Runtime::stream_mark)
      .def("release_ranges", &Runtime::release_ranges)
      .def("stream_release_ranges", &Runtime::stream_release_ranges)
      .def("prefetch", &Runtime::prefetch)
      .def("prefetch_ranges", &Runtime::prefetch_ranges)
      .def("offload", &Runtime::offload)
      .def("free_pages", &Runtime::free_pages)
      .def("acquire_host", &Runtime::acquire_host)
      .def("release_host", &Runtime::release_host)
      .def("set_schedule", &Runtime::set_schedule)
      .def("add_stall_ns", &Runtime::add_stall_ns)
      .def("advance", &Runtime::advance)
      .def("wait", &Runtime::wait)
      .def("completed_ticket", &Runtime::completed_ticket)
      .def("stream_wait", &Runtime::stream_wait)
      .def("stream_release", &Runtime::stream_release)
      .def("stats", &Runtime::stats)
      .def("map_counters", &Runtime::map_counters)
      .def("create_channel", &Runtime::create_channel)
      .def("open_channel", &Runtime::open_channel)
      .def("close_channel", &Runtime::close_channel)
      .def("space_pointer", &Runtime::space_pointer)
      .def("pool", &Runtime::pool);
}
