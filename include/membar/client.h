// The membar client API: what a trainer links. One interface, two runtimes behind it:
//   - the daemon client: talks to a membard daemon (Unix socket for control and descriptors, a
//     shared-memory ring for the hot path);
//   - embedded: the same engine running in this process (default when no daemon is reachable,
//     and on machines without a GPU).
// connect() picks: an explicit socket path, else $MEMBAR_SOCKET, else the default socket if a
// daemon answers there, else embedded.
//
// Memory layout (Note [Space layout] in engine/engine.cpp): a space is one contiguous range of
// this process's addresses on each tier, page p at base + p * page_bytes, whatever the page size.
// The runtime maps its memory there while it is resident; a range that is acquired is mapped and
// its contents are in place once its ticket completes. Outside acquired ranges the addresses may
// be unmapped (reading them faults) or hold stale contents.
//
// Threading: a Client may be used from several threads; calls are serialised internally.
// Every call that says "blocks" may wait for the runtime; none waits for GPU work unless it says so.
// A call the runtime answers with "retry" (UNAVAILABLE while frames are being cleared or pinned)
// is retried inside the client for up to $MEMBAR_RETRY_MS (default 60000) milliseconds.
#pragma once

#include <algorithm>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "membar/status.h"
#include "membar/types.h"

namespace membar {

enum class BackendKind : uint8_t { kAuto = 0, kHost = 1, kCuda = 2 };

struct EmbeddedConfig {
  BackendKind backend = BackendKind::kAuto;  // auto: CUDA when a GPU is present, else host
  uint64_t gpu_pool_bytes = 256ull << 20;    // frames made at start-up
  uint64_t host_pool_bytes = 1ull << 30;     // slabs prepared in the background
  int device = 0;
  // Copies wait for each other and for the stream's release markers on the device (Note
  // [Device-ordered copies] in engine/batches.cpp), so stream_wait needs no host wait.
  // MEMBAR_DEVICE_ORDER=0 in the environment turns it off (host order, as a daemon).
  bool order_on_device = true;
};

struct ConnectOptions {
  std::string socket_path;             // empty: $MEMBAR_SOCKET, then kDefaultSocketPath
  bool allow_embedded = true;          // fall back to an embedded runtime when no daemon answers
  EmbeddedConfig embedded;
  std::string client_name;             // shown by membarctl
  uint64_t gpu_quota_bytes = 0;        // 0: the daemon's default share
  uint64_t host_quota_bytes = 0;
  // The daemon's device to work on (a membard may serve several: Note [Devices of one daemon] in
  // membar/protocol/v2.h). Unset: the daemon's first device. A device it does not serve is its
  // NOT_FOUND ("this membard serves devices 0, 1; not 2"). Embedded mode uses embedded.device.
  std::optional<int> device;
};

inline constexpr const char* kDefaultSocketPath = "/run/membar/membard.sock";

enum AcquireFlags : uint32_t {
  kAcquireRead = 0,
  kAcquireWrite = 1u << 0,       // the client will write: the pages become dirty on release
  kAcquireZeroNew = 1u << 1,     // pages with no contents yet are zero-filled (default: undefined)
};

// Where a space lives in this process (both tiers), and its shape.
struct SpaceView {
  SpaceId id = 0;
  void* gpu = nullptr;       // page p at gpu + p * page_bytes (device pointers on CUDA)
  void* host = nullptr;      // page p at host + p * page_bytes (valid under acquire_host)
  uint64_t page_bytes = 0;
  uint32_t page_count = 0;
  uint64_t bytes = 0;        // page_bytes * page_count
};

struct Acquired {
  Ticket ticket = 0;         // ready when completed_ticket() >= ticket
  void* pointer = nullptr;   // the range's first page; page first + i at pointer + i * page_bytes
};

// A channel (engine/include/membar/engine/channels.h, Note [Channels]): a named shared-memory
// buffer that one client writes and other processes of the same user (on the same daemon) read.
struct Channel {
  uint32_t handle = 0;     // this client's handle, for close_channel
  void* data = nullptr;    // mapped in this process: read-write for the creator, read-only for openers
  uint64_t bytes = 0;
  bool writable = false;
  int fd = -1;             // the mapping's descriptor, owned by the Client until close_channel
};

// What this process's side of a client did with the runtime's frame events (Note [Maps off the
// caller's thread] in libclient/memory.cpp).
struct MapCounters {
  uint64_t events_applied = 0;  // frame events applied (grants, revokes, maps, unmaps)
  uint64_t maps = 0;            // positions mapped
  uint64_t map_runs = 0;        // calls that mapped them (a run of adjacent positions is one)
  uint64_t wait_ns = 0;         // callers' time waiting for events to be applied
  uint64_t apply_ns = 0;        // time applying them (on the mapping thread when asynchronous)
  bool asynchronous = false;
};

class Client {
 public:
  virtual ~Client() = default;

  // "embedded:host", "embedded:cuda", "daemon:/run/membar/membard.sock".
  virtual std::string describe() const = 0;
  virtual BackendKind backend() const = 0;
  // The CUDA device of this client's GPU tier (the daemon's answer, or the embedded runtime's);
  // a label on the host backend.
  virtual int device() const = 0;

  // Spaces. Names are unique per client; pages may have any size from 1 byte to kMaxPageBytes.
  // Blocks (one round trip).
  virtual Result<SpaceId> create_space(const std::string& name, uint64_t page_bytes, uint32_t page_count) = 0;
  virtual Status destroy_space(SpaceId space) = 0;
  // Non-blocking: where the space lives in this process.
  virtual Result<SpaceView> space_view(SpaceId space) const = 0;

  // Makes the pages GPU-resident (allocating, zero-filling or copying in as needed) at their
  // place in the space, pins them against eviction and returns the ticket to wait for. Blocks
  // until the request is accepted, not until the copies are done: wait(ticket) or
  // stream_wait(ticket, s).
  virtual Result<Acquired> acquire(PageRange range, uint32_t flags) = 0;
  // Unpins; with dirty, the GPU copy becomes the newest (written back before eviction).
  // The client's own writes to the pages must be complete when it calls release (on CUDA:
  // synchronize the stream that wrote them, or use stream_release, which orders on the GPU).
  virtual Status release(PageRange range, bool dirty) = 0;

  // Several ranges in one call, one round trip and one ticket (the pages one kernel reads from
  // several spaces); with `advance_step`, advance(step) first. A failure pins nothing.
  virtual Result<Ticket> acquire_ranges(const std::vector<PageRange>& ranges, uint32_t flags,
                                        std::optional<uint32_t> advance_step = std::nullopt) = 0;
  virtual Status release_ranges(const std::vector<PageRange>& ranges, bool dirty) = 0;

  // Copies the contents of pages into other pages of this client's spaces (Note [Copied pages] in
  // engine/page_copies.cpp): pairs[2i] names source pages, pairs[2i + 1] as many destination pages
  // of a space with the same page size (not overlapping the source). Sources keep their
  // residency and are read where their newest contents are (pages without contents read as
  // zeros); each destination frame is written where it lives: the GPU frame when resident, else
  // the host frame. So a trainer can stream pages that stay in host memory through a few
  // GPU-resident pages it keeps acquired, with no frame placed or mapped per read. With
  // `after_marker` (CUDA backend: a marker stream_mark returned) the copies run only once the
  // stream that wrote the marker has passed it, so the kernels it names (those that read or wrote
  // the destination before) are done; nullopt: at once. Returns the ticket (wait / stream_wait).
  // At most 2048 pairs per call.
  virtual Result<Ticket> copy_pages(const std::vector<PageRange>& pairs, std::optional<uint64_t> after_marker) = 0;
  // Enqueues a release marker on `cuda_stream` (as stream_release does, naming no pages) and
  // returns it: work ordered after it (copy_pages' after_marker) waits for what the stream had
  // enqueued before this call, not for what it enqueues later. UNIMPLEMENTED on the host backend.
  virtual Result<uint64_t> stream_mark(void* cuda_stream) = 0;

  // Asynchronous hints; return when accepted.
  virtual Result<Ticket> prefetch(PageRange range) = 0;   // bring to GPU, do not pin
  // prefetch of several ranges in one call (through membard: one round trip); the ticket covers
  // every copy issued. A range that fails stops the call with its error (the earlier ones stay
  // prefetched: a hint).
  virtual Result<Ticket> prefetch_ranges(const std::vector<PageRange>& ranges) {
    Ticket last = 0;
    for (const PageRange& range : ranges) {
      MEMBAR_ASSIGN_OR_RETURN(Ticket ticket, prefetch(range));
      last = std::max(last, ticket);
    }
    return last;
  }
  virtual Result<Ticket> offload(PageRange range) = 0;    // write back to host, free GPU frames
  virtual Status free_pages(PageRange range) = 0;         // drop contents in both tiers

  // Host access (CPU reads/writes of page contents, e.g. checkpointing or the host backend's
  // CPU kernels): makes the pages host-resident and returns the host pointer of the first page,
  // valid until release_host. Blocks until the data is there.
  virtual Result<void*> acquire_host(PageRange range) = 0;
  virtual Status release_host(PageRange range, bool dirty) = 0;

  // Access schedule: steps the client will run, in order (may repeat pages). advance(i) says
  // step i is about to run: the runtime prefetches ahead within the client's GPU quota and
  // evicts what is needed farthest in the future (Belady), writing dirty pages back.
  virtual Status set_schedule(std::vector<ScheduleStep> steps) = 0;
  virtual Status advance(uint32_t step) = 0;

  // Completion. wait blocks the calling thread (INVALID_ARGUMENT at once for a ticket never
  // issued); stream_wait enqueues a wait on a CUDA stream (cudaStream_t passed as void*;
  // UNIMPLEMENTED on the host backend) so no CPU round trip is needed (an embedded client first
  // waits on the host until the ticket's copies are enqueued: Note [Enqueued tickets] in
  // engine/batches.cpp, at once when they are ordered on the device); stream_release enqueues
  // "the GPU is done with these pages" on the stream.
  virtual Status wait(Ticket ticket) = 0;
  virtual Ticket completed_ticket() const = 0;
  virtual Status stream_wait(Ticket ticket, void* cuda_stream) = 0;
  // True when stream_wait never leaves the stream waiting for a host thread of this process:
  // through a daemon, or embedded with copies ordered on the device. A trainer then waits on its
  // stream; otherwise with wait() on the host (Note [Runtime pages] in membar/oomb/runtime_store.py).
  virtual bool stream_waits_preferred() const = 0;
  virtual Status stream_release(PageRange range, bool dirty, void* cuda_stream) = 0;
  virtual Status stream_release_ranges(const std::vector<PageRange>& ranges, bool dirty, void* cuda_stream) = 0;
  // Time this client waited for pages that the library cannot see, measured by the caller (a
  // CUDA stream's wait after stream_wait, timed with events): added to the client's stall time,
  // which wait() already counts, so that operators (membarctl stats / top) see every wait.
  // Through a daemon it travels with the next request.
  virtual Status add_stall_ns(uint64_t ns) = 0;

  // This client's stats: tiers, its counters, its spaces (the first kMaxStatsSpaces of them).
  virtual Result<RuntimeStats> stats() = 0;
  // This process's mapping of the runtime's frames: maps applied, how many calls mapped them,
  // and the calls' waits for them (MEMBAR_ASYNC_MAPS=1 maps on a thread of the
  // client library's own; by default on the thread that receives the events).
  virtual MapCounters map_counters() const = 0;

  // Channels. create_channel makes a zero-filled channel of `bytes` (counted against the host
  // quota) under a name unique among this user's channels on the daemon (ALREADY_EXISTS
  // otherwise), maps it writable and publishes it; open_channel maps a published one read-only
  // (NOT_FOUND when no channel of that name is visible: another user's, closed, or its creator
  // gone). With an embedded runtime only channels created in this process are found.
  // close_channel unmaps; the creator's close also drops the name (mappings other processes
  // hold stay valid). Destroying the Client closes its channels. Blocks (one round trip).
  virtual Result<Channel> create_channel(const std::string& name, uint64_t bytes) = 0;
  virtual Result<Channel> open_channel(const std::string& name) = 0;
  virtual Status close_channel(uint32_t handle) = 0;
};

// Connects to a daemon or starts an embedded runtime (see the header comment).
Result<std::unique_ptr<Client>> connect(const ConnectOptions& options = {});
// An embedded runtime, always.
Result<std::unique_ptr<Client>> make_embedded_client(const EmbeddedConfig& config = {});

// A daemon client, always: connects to the membard at `socket_path` and completes the
// handshake. UNAVAILABLE when no daemon answers there; the daemon's own error
// (PERMISSION_DENIED, FAILED_PRECONDITION for a protocol version mismatch, RESOURCE_EXHAUSTED ...)
// when it refuses. Blocks (bounded: 5 s).
//
// Timeouts (environment, milliseconds): MEMBAR_CALL_TIMEOUT_MS (default 30000) bounds every
// request's round trip, MEMBAR_WAIT_TIMEOUT_MS (default 120000) bounds wait(ticket). A call
// never hangs on a dead daemon: it returns UNAVAILABLE within a few milliseconds of the
// daemon's socket closing, and every later call returns UNAVAILABLE too.
Result<std::unique_ptr<Client>> connect_daemon(const std::string& socket_path, const ConnectOptions& options);

// One empty round trip through a daemon client's rings (the daemon answers without the engine):
// the request-latency benchmark's unit. INVALID_ARGUMENT when `client` is not a daemon client.
Status daemon_client_nop(Client& client);

}  // namespace membar
