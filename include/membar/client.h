// The membar client API: what a trainer links. One interface, two runtimes behind it:
//   - DaemonClient: talks to a membard daemon (Unix socket for control and fd passing,
//     a shared-memory ring for the hot path);
//   - embedded: the same engine running in this process (default when no daemon is reachable,
//     and on machines without a GPU).
// connect() picks: an explicit socket path, else $MEMBAR_SOCKET, else the default socket if a
// daemon answers there, else embedded.
//
// Threading: a Client may be used from several threads; calls are serialised internally.
// Every call that says "blocks" may wait for the runtime; none waits for GPU work unless it says so.
#pragma once

#include <memory>
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
  uint64_t host_pool_bytes = 1ull << 30;
  int device = 0;
};

struct ConnectOptions {
  std::string socket_path;             // empty: $MEMBAR_SOCKET, then kDefaultSocketPath
  bool allow_embedded = true;          // fall back to an embedded runtime when no daemon answers
  EmbeddedConfig embedded;
  std::string client_name;             // shown by membarctl
  uint64_t gpu_quota_bytes = 0;        // 0: the daemon's default share
  uint64_t host_quota_bytes = 0;
};

inline constexpr const char* kDefaultSocketPath = "/run/membar/membard.sock";

enum AcquireFlags : uint32_t {
  kAcquireRead = 0,
  kAcquireWrite = 1u << 0,       // the client will write: the page becomes dirty on release
  kAcquireZeroNew = 1u << 1,     // pages with no contents yet are zero-filled (default: undefined)
};

struct Acquired {
  Ticket ticket = 0;                   // ready when completed_ticket() >= ticket
  std::vector<void*> page_pointers;    // one per page, in the client's address space (device
                                       // pointers on CUDA, host pointers on the host backend)
};

// A channel (runtimed/channels.h, Note [Channels]): a named shared-memory buffer that one
// client writes and other processes of the same user (on the same daemon) read.
struct Channel {
  uint32_t handle = 0;     // this client's handle, for close_channel
  void* data = nullptr;    // mapped in this process: read-write for the creator, read-only for openers
  uint64_t bytes = 0;
  bool writable = false;
  int fd = -1;             // the mapping's descriptor, owned by the Client until close_channel
};

class Client {
 public:
  virtual ~Client() = default;

  // "embedded:host", "embedded:cuda", "daemon:/run/membar/membard.sock".
  virtual std::string describe() const = 0;
  virtual BackendKind backend() const = 0;

  // Spaces. Names are unique per client; page_bytes is a power of two in [64 KiB, 2 MiB].
  // Blocks (one round trip).
  virtual Result<SpaceId> create_space(const std::string& name, uint64_t page_bytes,
                                       uint32_t page_count) = 0;
  virtual Status destroy_space(SpaceId space) = 0;

  // Makes the pages GPU-resident (allocating, zero-filling or copying in as needed), pins them
  // against eviction and returns their pointers plus the ticket to wait for. Blocks until the
  // request is accepted, not until the copies are done: wait(ticket) or stream_wait(ticket, s).
  virtual Result<Acquired> acquire(PageRange range, uint32_t flags) = 0;
  // Unpins; with dirty, the GPU copy becomes the newest (written back before eviction).
  // The client's own writes to the pages must be complete when it calls release (on CUDA:
  // synchronize the stream that wrote them, or use stream_release, which orders on the GPU).
  virtual Status release(PageRange range, bool dirty) = 0;

  // Asynchronous hints; return when accepted.
  virtual Result<Ticket> prefetch(PageRange range) = 0;   // bring to GPU, do not pin
  virtual Result<Ticket> offload(PageRange range) = 0;    // write back to host, free GPU slot
  virtual Status free_pages(PageRange range) = 0;         // drop contents in both tiers

  // Host access (CPU reads/writes of page contents, e.g. checkpointing or the host backend's
  // CPU kernels): makes the pages host-resident and returns host pointers valid until
  // release_host. Blocks until the data is there.
  virtual Result<std::vector<void*>> acquire_host(PageRange range) = 0;
  virtual Status release_host(PageRange range, bool dirty) = 0;

  // Access schedule: steps the client will run, in order (may repeat pages). advance(i) says
  // step i is about to run: the runtime prefetches ahead within the client's GPU quota and
  // evicts the page whose next use is farthest (Belady), writing dirty pages back.
  virtual Status set_schedule(std::vector<ScheduleStep> steps) = 0;
  virtual Status advance(uint32_t step) = 0;

  // Completion. wait blocks the calling thread; stream_wait enqueues a wait on a CUDA stream
  // (cudaStream_t passed as void*; UNIMPLEMENTED on the host backend) so no CPU round trip is
  // needed; stream_release enqueues "the GPU is done with these pages" on the stream.
  virtual Status wait(Ticket ticket) = 0;
  virtual Ticket completed_ticket() const = 0;
  virtual Status stream_wait(Ticket ticket, void* cuda_stream) = 0;
  virtual Status stream_release(PageRange range, bool dirty, void* cuda_stream) = 0;

  // The client's window: all its GPU pages live in [window_base, window_base + window_bytes).
  // A pool tensor over the window, viewed with a space's page size, indexes pages by
  // (window_frame * kFrameBytes + slot * page_bytes) / page_bytes.
  virtual void* window_base() const = 0;
  virtual uint64_t window_bytes() const = 0;
  // Page locations (GPU tier) as last reported; kNoFrame when not GPU-resident.
  virtual Result<std::vector<PageLocation>> locations(PageRange range) = 0;

  virtual Result<RuntimeStats> stats() = 0;

  // Channels. create_channel makes a zero-filled channel of `bytes` (counted against the host
  // quota) under a name unique on the daemon (ALREADY_EXISTS otherwise); open_channel maps an
  // existing one read-only (NOT_FOUND when no channel of that name is visible: another user's,
  // closed, or its creator gone). With an embedded runtime only channels created in this process
  // are found. close_channel unmaps; the creator's close also drops the name (mappings other
  // processes hold stay valid). Destroying the Client closes its channels. Blocks (one round trip).
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
