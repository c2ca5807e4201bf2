// CudaVmmBackend: the DeviceBackend of a machine with an NVIDIA GPU.
//
// Note [CUDA frames and copies]
// Rationale: frames must be shareable with client processes one at a time (a client may map only
// the frames that hold its pages), cheap to hand out (never cuMemCreate on the hot path), renewable
// when they change hands (Note [Frames, slabs and renewal] in engine/frames.cpp), and copies
// between tiers must run at PCIe speed without the trainer's process or streams being involved.
// Approach:
//   - GPU frames: one cuMemCreate'd 2 MiB allocation per frame, exportable as a POSIX fd
//     (cuMemMap's offset must be 0, so one allocation = one frame), all made and zeroed at
//     start-up and mapped back to back into one reservation of the daemon's own VA, so adjacent
//     frames are adjacent addresses. Renewal releases the allocation and maps a new zeroed one at
//     the same address (~60 us: create ~11 us, set-access ~30 us, unmap ~18 us on the H200).
//     No descriptor is kept: a frame is exported when it is granted.
//   - Host slabs: one sealed memfd per slab (the client cannot resize it), mapped over the slab's
//     place in one PROT_NONE reservation, populated and page-locked with cuMemHostRegister (one
//     registration per slab). Renewal unregisters the old memfd and maps, populates and registers
//     a new one; slabs are renewed on threads of their own (~0.4-0.8 s per GiB on the H200 VM:
//     populating the pages dominates, one CPU each; four slabs at a time), so GPU renewals never
//     wait behind them. Pinned shared
//     memory copies as fast as cudaHostAlloc memory (measured 51.7 / 52.8 GB/s).
//   - Copies run on two non-blocking streams owned by the daemon, one per direction, so
//     prefetch and offload use both copy engines at once. Ops of a batch are sorted and
//     adjacent ones merged (never across a slab, a registration of its own): 64 KiB copies run at
//     a third of PCIe speed, merged ones at full.
//   - Copies handed over in one call: Note [Copies handed over in one call] below.
//   - Completion: a word per stream written in stream order after each batch (Note [Completion
//     words]), or where that is off an event per stream per batch, waited on by one completion
//     thread per stream (events are blocking-sync, so the threads sleep instead of spinning). The thread
//     that finishes a batch's last part calls `done`. cudaLaunchHostFunc is not used because
//     `done` may enqueue more work, and CUDA calls are not allowed inside a host function.
//   - Signal blocks: sealed memfd pages, registered with CU_MEMHOSTREGISTER_DEVICEMAP; a
//     third stream waits for both copy streams (events) and then cuStreamWriteValue64's the
//     word, so a signal never delays later copies. The client registers the same memfd in its
//     own process and waits with cuStreamWaitValue64 (libclient/cuda/stream_signal.h).
// Limitations: one mmap per slab counts against vm.max_map_count (far below its default); the
// whole host pool is page-locked once prepared.
#include <cuda.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "membar/engine/backend.h"
#include "membar/engine/copy_plan.h"
#include "membar/engine/numa.h"
#include "membar/common/cuda/driver_api.h"
#include "membar/common/cuda/resources.h"

namespace membar::runtimed {
namespace {

using cuda::AddressReservation;
using cuda::DeviceMapping;
using cuda::DriverApi;
using cuda::driver_status;
using cuda::HostMapping;
using cuda::HostRegistration;
using cuda::PhysicalAllocation;
using cuda::PrimaryContext;
using cuda::ScopedFd;

constexpr uint32_t kMaxSignalWords = 4096;

Status runtime_status(cudaError_t error, std::string_view what) {
  if (error == cudaSuccess) return Status::Ok();
  StatusCode code = StatusCode::INTERNAL;
  switch (error) {
    case cudaErrorMemoryAllocation:
      code = StatusCode::RESOURCE_EXHAUSTED;
      break;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
      code = StatusCode::UNAVAILABLE;
      break;
    case cudaErrorInvalidValue:
      code = StatusCode::INVALID_ARGUMENT;
      break;
    default:
      break;
  }
  std::string message(what);
  message += " failed: ";
  message += cudaGetErrorName(error);
  message += " (";
  message += cudaGetErrorString(error);
  message += ")";
  return Status(code, std::move(message));
}

Status errno_status(std::string_view what) {
  int error = errno;
  StatusCode code = (error == ENOMEM || error == EMFILE || error == ENFILE) ? StatusCode::RESOURCE_EXHAUSTED
                                                                           : StatusCode::INTERNAL;
  return Status(code, std::string(what) + " failed: " + std::strerror(error));
}

const char* tier_name(Tier tier) { return tier == Tier::kGpu ? "GPU" : "host"; }

// A stream created with cudaStreamNonBlocking (no implicit sync with the legacy stream).
class CudaStream {
 public:
  CudaStream() = default;
  CudaStream(CudaStream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  CudaStream& operator=(CudaStream&& other) noexcept {
    if (this != &other) {
      reset();
      stream_ = std::exchange(other.stream_, nullptr);
    }
    return *this;
  }
  ~CudaStream() { reset(); }
  static Result<CudaStream> create() {
    CudaStream stream;
    MEMBAR_RETURN_IF_ERROR(runtime_status(cudaStreamCreateWithFlags(&stream.stream_, cudaStreamNonBlocking),
                                          "cudaStreamCreateWithFlags"));
    return stream;
  }
  cudaStream_t get() const { return stream_; }
  void reset() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

 private:
  cudaStream_t stream_ = nullptr;
};

// Events for completion and stream ordering: no timing, blocking sync (waiters sleep).
class CudaEvent {
 public:
  CudaEvent() = default;
  CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& other) noexcept {
    if (this != &other) {
      reset();
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }
  ~CudaEvent() { reset(); }
  static Result<CudaEvent> create() {
    CudaEvent event;
    MEMBAR_RETURN_IF_ERROR(runtime_status(
        cudaEventCreateWithFlags(&event.event_, cudaEventDisableTiming | cudaEventBlockingSync),
        "cudaEventCreateWithFlags"));
    return event;
  }
  cudaEvent_t get() const { return event_; }
  void reset() {
    if (event_ != nullptr) cudaEventDestroy(event_);
    event_ = nullptr;
  }

 private:
  cudaEvent_t event_ = nullptr;
};

// Device memory from cudaMalloc (the zero source for host-tier zero fills).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept : pointer_(std::exchange(other.pointer_, nullptr)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      pointer_ = std::exchange(other.pointer_, nullptr);
    }
    return *this;
  }
  ~DeviceBuffer() { reset(); }
  static Result<DeviceBuffer> create(uint64_t bytes) {
    DeviceBuffer buffer;
    MEMBAR_RETURN_IF_ERROR(runtime_status(cudaMalloc(&buffer.pointer_, bytes), "cudaMalloc"));
    return buffer;
  }
  void* get() const { return pointer_; }
  void reset() {
    if (pointer_ != nullptr) cudaFree(pointer_);
    pointer_ = nullptr;
  }

 private:
  void* pointer_ = nullptr;
};

// A sealed memfd of `bytes` mapped shared into this process. The seals stop any process that
// receives the fd from growing or shrinking it (a shrink would SIGBUS the daemon).
struct SharedMemory {
  ScopedFd fd;
  HostMapping mapping;
};

Result<ScopedFd> create_sealed_memfd(const char* name, uint64_t bytes) {
  ScopedFd fd(memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fd.get() < 0) return errno_status("memfd_create");
  if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) return errno_status("ftruncate of a memfd");
  if (fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return errno_status("sealing a memfd");
  }
  return fd;
}

Result<SharedMemory> create_shared_memory(const char* name, uint64_t bytes) {
  SharedMemory memory;
  MEMBAR_ASSIGN_OR_RETURN(memory.fd, create_sealed_memfd(name, bytes));
  void* pointer = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memory.fd.get(), 0);
  if (pointer == MAP_FAILED) return errno_status("mmap of a memfd");
  memory.mapping = HostMapping(pointer, bytes);
  return memory;
}

struct SignalBlock {
  SharedMemory memory;
  HostRegistration registration;  // declared after memory: unregistered before munmap
  CUdeviceptr device_words = 0;
  uint32_t words = 0;
};

// What the parts of one batch share; the part that finishes last calls `done`.
struct Batch {
  std::atomic<int> parts_left{0};
  std::mutex mutex;
  Status status;  // first error of any part
  std::function<void(Status)> done;
};

struct PendingPart {
  cudaEvent_t event = nullptr;  // or, with completion words, null and:
  uint64_t sequence = 0;        // the value the stream's completion word reaches after this part
  std::shared_ptr<Batch> batch;
};

class CudaVmmBackend final : public DeviceBackend {
 public:
  static Result<std::unique_ptr<DeviceBackend>> create(const BackendConfig& config);
  ~CudaVmmBackend() override;

  std::string name() const override { return "cuda"; }
  int host_numa_node() const override { return numa_node_; }
  std::string host_numa_note() const override { return numa_note_; }
  uint64_t frame_count(Tier tier) const override {
    return tier == Tier::kGpu ? gpu_frames_.size() : host_frame_count_;
  }
  uint32_t host_slab_frames() const override { return slab_frames_; }
  Result<int> export_gpu_frame(FrameIndex frame) override;
  Result<int> export_host_slab(uint32_t slab) override;
  Status release_host_slab(uint32_t slab, std::function<void(Status)> done) override;
  Status renew(Tier tier, uint32_t index, std::function<void(Status)> done) override;
  BackendCounters counters() const override {
    return {copy_ops_.load(), transfers_.load(), bytes_copied_.load(), zero_fills_.load(), renewals_.load()};
  }
  void* frame_pointer(Tier tier, FrameIndex frame) override;
  Status enqueue_copies(std::vector<CopyOp> ops, std::function<void(Status)> done,
                        const DeviceOrder& order) override;
  Status enqueue_zero(Tier tier, FrameIndex frame, uint64_t offset, uint64_t bytes, std::function<void(Status)> done,
                      const DeviceOrder& order) override;
  // Needs 64-bit stream memory operations (cuStreamWaitValue64 on the copy streams); without them
  // the engine keeps host order.
  bool orders_on_device() const override { return stream_mem_ops_; }
  void drain() override;
  Result<uint32_t> create_signal_block(uint32_t words) override;
  Status destroy_signal_block(uint32_t block) override;
  Result<int> export_signal_block(uint32_t block) override;
  volatile uint64_t* signal_words(uint32_t block) override;
  Status enqueue_signal(uint32_t block, uint32_t index, uint64_t value) override;

 private:
  // Index of a copy stream and of its completion queue.
  enum StreamIndex : int { kHostToDevice = 0, kDeviceToHost = 1, kCopyStreamCount = 2 };

  struct CompletionQueue {
    std::mutex mutex;
    std::condition_variable ready;
    std::deque<PendingPart> parts;
    bool stopping = false;
    std::thread thread;
  };

  explicit CudaVmmBackend(const BackendConfig& config)
      : config_(config), injected_renewal_failures_(static_cast<int64_t>(config.fail_renewal_attempts)) {}
  Status initialize();
  Status create_gpu_frames(uint64_t count);
  Status reserve_host_pool();
  // The renewals themselves, on the renewal threads (Note [CUDA frames and copies]).
  Status renew_gpu_frame_now(FrameIndex frame);
  Status renew_slab_now(uint32_t slab);
  Status release_slab_now(uint32_t slab);
  void renewal_loop(int queue);
  Status start();
  // Makes the device's primary context current on the calling thread (every public entry).
  Status bind_device() const;
  char* pointer(Tier tier, FrameIndex frame) const;
  Status check_range(Tier tier, FrameIndex frame, uint64_t offset, uint64_t bytes, const char* what) const;
  // Makes copy stream `stream` wait on the device for what `order` names (caller holds mutex_).
  Status apply_order(int stream, const DeviceOrder& order);
  // Zeroed words in a sealed memfd, pinned and mapped for the device: a signal block's memory (the
  // clients' and the copy streams' completion words).
  Result<std::unique_ptr<SignalBlock>> make_signal_memory(const char* name, uint32_t words);
  // The device address of word `index` of signal block `block` (caller holds mutex_).
  Result<CUdeviceptr> signal_word_address(uint32_t block, uint32_t index) const;
  // Records an event on each stream in `streams`, queues one part per stream and counts the
  // batch as outstanding. Called with mutex_ held, after the batch's work is enqueued.
  Status finish_enqueue(const std::vector<int>& streams, std::function<void(Status)> done);
  // Hands one stream's merged transfers to the driver (caller holds mutex_).
  Status issue_transfers(int stream, const std::vector<Transfer>& transfers);
  Result<cudaEvent_t> take_event();
  void give_event(cudaEvent_t event);
  void completion_loop(int stream);
  void finish_part(const std::shared_ptr<Batch>& batch, Status status);

  BackendConfig config_;
  std::unique_ptr<DriverApi> api_;  // this backend's own table: fault injection stays local
  PrimaryContext context_;

  // GPU pool. Destruction runs bottom-up: mappings, then reservation, then allocations.
  std::vector<PhysicalAllocation> gpu_frames_;
  AddressReservation gpu_reservation_;
  std::vector<DeviceMapping> gpu_mappings_;

  // Host pool: one PROT_NONE reservation, each prepared slab's memfd mapped over its place.
  HostMapping host_reservation_;
  uint64_t host_frame_count_ = 0;
  uint32_t slab_frames_ = 1;
  std::atomic<int64_t> injected_renewal_failures_{0};  // BackendConfig::fail_renewal_attempts
  std::mutex slab_mutex_;                  // guards slab_fds_ (the renewal thread replaces them)
  std::vector<ScopedFd> slab_fds_;
  std::vector<HostRegistration> slab_registrations_;
  int numa_node_ = numa::kNoPlacement;   // Note [Host pools near their GPU]
  std::string numa_note_;
  // Renewals: queue 0 for GPU frames (one thread: one renewal stream), 1 for host slabs
  // (kSlabThreads threads: populating a slab's pages is one CPU's work, ~1.3 GiB/s on the H200 VM,
  // so a 100 GiB pool took 62 s to pin on one thread).
  struct RenewalJob {
    uint32_t index;
    std::function<void(Status)> done;
    bool release = false;  // host slab: drop its memory instead (release_host_slab)
  };
  struct RenewalQueue {
    std::mutex mutex;
    std::condition_variable ready;
    std::condition_variable idle;
    std::deque<RenewalJob> jobs;
    int busy = 0;
    bool stopping = false;
    std::vector<std::thread> threads;
  };
  static constexpr int kSlabThreads = 4;
  RenewalQueue renewal_[2];
  std::atomic<uint64_t> renewals_{0};
  CudaStream renewal_stream_;  // zero fills of renewed GPU frames

  DeviceBuffer zero_source_;  // kFrameBytes of zeros, source of host-tier zero fills

  // mutex_ guards the streams (enqueue order = completion queue order), the event pool and
  // the signal blocks.
  mutable std::mutex mutex_;
  CudaStream copy_streams_[kCopyStreamCount];
  CudaStream signal_stream_;
  CudaEvent signal_after_[kCopyStreamCount];  // re-recorded for every signal
  CudaEvent order_after_[kCopyStreamCount];   // re-recorded for every after_enqueued order
  bool stream_mem_ops_ = false;               // CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
  // Note [Copies handed over in one call]: whether to use cudaMemcpyBatchAsync, whether a call of
  // it has succeeded yet, and its argument arrays (reused, under mutex_).
  bool batch_copies_ = true;
  bool batch_copies_worked_ = false;
  // Note [Completion words]: host-mapped words, one per copy stream, the last value written to each
  // (under mutex_), and whether they are used.
  bool completion_words_ = false;
  std::unique_ptr<SignalBlock> completion_block_;
  uint64_t completion_sequence_[2] = {0, 0};
  // Waits until stream `stream`'s completion word reaches `sequence` (completion threads).
  Status wait_completion_word(int stream, uint64_t sequence);
  std::vector<void*> batch_destinations_;
  std::vector<const void*> batch_sources_;
  std::vector<size_t> batch_sizes_;
  std::vector<CudaEvent> events_;             // every event made, destroyed at the end
  std::vector<cudaEvent_t> free_events_;
  std::map<uint32_t, std::unique_ptr<SignalBlock>> signal_blocks_;
  uint32_t next_signal_block_ = 1;

  std::atomic<uint64_t> copy_ops_{0};
  std::atomic<uint64_t> transfers_{0};
  std::atomic<uint64_t> bytes_copied_{0};
  std::atomic<uint64_t> zero_fills_{0};

  std::mutex outstanding_mutex_;
  std::condition_variable outstanding_zero_;
  uint64_t outstanding_batches_ = 0;

  CompletionQueue completion_[kCopyStreamCount];
};

Result<std::unique_ptr<DeviceBackend>> CudaVmmBackend::create(const BackendConfig& config) {
  if (config.gpu_pool_bytes % kFrameBytes != 0 || config.host_pool_bytes % kFrameBytes != 0) {
    return invalid_argument("pool sizes must be multiples of the 2 MiB frame size (GPU pool " +
                            std::to_string(config.gpu_pool_bytes) + " bytes, host pool " +
                            std::to_string(config.host_pool_bytes) + " bytes)");
  }
  std::unique_ptr<CudaVmmBackend> backend(new CudaVmmBackend(config));
  const char* batch_env = std::getenv("MEMBAR_BATCH_COPIES");
  backend->batch_copies_ = config.batch_copies && !(batch_env != nullptr && std::string(batch_env) == "0");
  const char* events_env = std::getenv("MEMBAR_COPY_EVENTS");
  backend->completion_words_ = config.completion_words && !(events_env != nullptr && std::string(events_env) == "1");
  MEMBAR_RETURN_IF_ERROR(backend->initialize());
  return std::unique_ptr<DeviceBackend>(std::move(backend));
}

Status CudaVmmBackend::initialize() {
  MEMBAR_ASSIGN_OR_RETURN(api_, DriverApi::load("libcuda.so.1"));
  MEMBAR_ASSIGN_OR_RETURN(context_, cuda::retain_primary_context(api_.get(), config_.device));
  MEMBAR_RETURN_IF_ERROR(bind_device());

  uint64_t gpu_count = config_.gpu_pool_bytes / kFrameBytes;
  uint64_t host_count = config_.host_pool_bytes / kFrameBytes;
  // Fault injection counts frames of both tiers, GPU frames first; a GPU frame fails inside
  // the driver table (the path a full GPU takes), a host frame in create_host_frames.
  if (config_.fail_frame_create_after != 0 && config_.fail_frame_create_after <= gpu_count) {
    api_->faults().mem_create_successes_left = static_cast<int64_t>(config_.fail_frame_create_after - 1);
  }
  (void)host_count;
  MEMBAR_RETURN_IF_ERROR(create_gpu_frames(gpu_count));
  // The host pool goes on the NUMA node nearest this GPU (Note [Host pools near their GPU]).
  int nearest = -1;
  if (api_->cuDeviceGetAttribute(&nearest, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, context_.device()) != CUDA_SUCCESS) {
    nearest = -1;   // an older driver: it does not know the attribute
  }
  MEMBAR_ASSIGN_OR_RETURN(numa_node_, numa::resolve_node(config_.host_numa_node, nearest, &numa_note_));
  MEMBAR_RETURN_IF_ERROR(reserve_host_pool());
  return start();
}

Status CudaVmmBackend::bind_device() const {
  MEMBAR_RETURN_IF_ERROR(cuda::bind_context(api_.get(), context_.get()));
  return runtime_status(cudaSetDevice(config_.device), "cudaSetDevice");
}

Status CudaVmmBackend::create_gpu_frames(uint64_t count) {
  if (count == 0) return Status::Ok();
  CUmemAllocationProp properties = {};
  properties.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  properties.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  properties.location.id = context_.device();
  properties.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t granularity = 0;
  MEMBAR_RETURN_IF_ERROR(driver_status(
      api_.get(),
      api_->cuMemGetAllocationGranularity(&granularity, &properties, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
      "cuMemGetAllocationGranularity"));
  if (granularity == 0 || kFrameBytes % granularity != 0) {
    return unimplemented("this GPU's VMM allocation granularity (" + std::to_string(granularity) +
                         " bytes) does not divide the 2 MiB frame size");
  }

  CUdeviceptr base = 0;
  uint64_t bytes = count * kFrameBytes;
  MEMBAR_RETURN_IF_ERROR(driver_status(api_.get(), api_->cuMemAddressReserve(&base, bytes, kFrameBytes, 0, 0),
                                       "cuMemAddressReserve of the GPU pool"));
  gpu_reservation_ = AddressReservation(api_.get(), base, bytes);
  gpu_frames_.reserve(count);
  gpu_mappings_.reserve(count);
  for (uint64_t frame = 0; frame < count; ++frame) {
    CUmemGenericAllocationHandle handle = 0;
    CUresult result = api_->mem_create(&handle, kFrameBytes, &properties, 0);
    if (result != CUDA_SUCCESS) {
      return driver_status(api_.get(), result,
                           "cuMemCreate of GPU frame " + std::to_string(frame + 1) + " of " + std::to_string(count) +
                               " (the GPU pool is " + std::to_string(bytes >> 20) + " MiB)");
    }
    gpu_frames_.emplace_back(api_.get(), handle);
    CUdeviceptr address = base + frame * kFrameBytes;
    MEMBAR_RETURN_IF_ERROR(
        driver_status(api_.get(), api_->cuMemMap(address, kFrameBytes, 0, handle, 0), "cuMemMap of a GPU frame"));
    gpu_mappings_.emplace_back(api_.get(), address, kFrameBytes);
  }
  CUmemAccessDesc access = cuda::device_read_write_access(context_.device());
  MEMBAR_RETURN_IF_ERROR(
      driver_status(api_.get(), api_->cuMemSetAccess(base, bytes, &access, 1), "cuMemSetAccess of the GPU pool"));
  // Frames hold zeros before anyone sees them (Note [Frames, slabs and renewal]).
  MEMBAR_RETURN_IF_ERROR(runtime_status(cudaMemset(reinterpret_cast<void*>(base), 0, bytes), "cudaMemset of the GPU pool"));
  return runtime_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

Status CudaVmmBackend::reserve_host_pool() {
  slab_frames_ = config_.host_slab_frames != 0 ? config_.host_slab_frames : host_slab_frames_for(config_.host_pool_bytes);
  host_frame_count_ = config_.host_pool_bytes / kFrameBytes / slab_frames_ * slab_frames_;
  if (host_frame_count_ == 0) return Status::Ok();
  uint64_t bytes = host_frame_count_ * kFrameBytes;
  void* base = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return errno_status("reserving address space for the host pool");
  host_reservation_ = HostMapping(base, bytes);
  slab_fds_.resize(host_frame_count_ / slab_frames_);
  slab_registrations_.resize(host_frame_count_ / slab_frames_);
  return Status::Ok();
}

Result<int> CudaVmmBackend::export_host_slab(uint32_t slab) {
  std::lock_guard<std::mutex> lock(slab_mutex_);
  if (slab >= slab_fds_.size() || slab_fds_[slab].get() < 0) {
    return failed_precondition("host slab " + std::to_string(slab) + " is not prepared");
  }
  int fd = fcntl(slab_fds_[slab].get(), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return errno_status("duplicating a host slab's fd");
  return fd;
}

Status CudaVmmBackend::renew(Tier tier, uint32_t index, std::function<void(Status)> done) {
  if (!done) return invalid_argument("renew needs a completion callback");
  if (tier == Tier::kGpu && index >= gpu_frames_.size()) {
    return out_of_range("GPU frame " + std::to_string(index) + " does not exist");
  }
  if (tier == Tier::kHost && index >= slab_fds_.size()) {
    return out_of_range("host slab " + std::to_string(index) + " does not exist");
  }
  RenewalQueue& queue = renewal_[tier == Tier::kGpu ? 0 : 1];
  {
    std::lock_guard<std::mutex> lock(queue.mutex);
    queue.jobs.push_back(RenewalJob{index, std::move(done)});
  }
  queue.ready.notify_one();
  return Status::Ok();
}

Status CudaVmmBackend::release_host_slab(uint32_t slab, std::function<void(Status)> done) {
  if (!done) return invalid_argument("release_host_slab needs a completion callback");
  if (slab >= slab_fds_.size()) return out_of_range("host slab " + std::to_string(slab) + " does not exist");
  RenewalQueue& queue = renewal_[1];
  {
    std::lock_guard<std::mutex> lock(queue.mutex);
    queue.jobs.push_back(RenewalJob{slab, std::move(done), true});
  }
  queue.ready.notify_one();
  return Status::Ok();
}

Status CudaVmmBackend::release_slab_now(uint32_t slab) {
  uint64_t bytes = uint64_t(slab_frames_) * kFrameBytes;
  char* address = static_cast<char*>(host_reservation_.get()) + uint64_t(slab) * bytes;
  slab_registrations_[slab].reset();
  void* dropped = mmap(address, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (dropped == MAP_FAILED) return errno_status("dropping a host slab");
  std::lock_guard<std::mutex> lock(slab_mutex_);
  slab_fds_[slab] = ScopedFd();
  return Status::Ok();
}

void CudaVmmBackend::renewal_loop(int which) {
  (void)bind_device();
  RenewalQueue& queue = renewal_[which];
  for (;;) {
    RenewalJob job;
    {
      std::unique_lock<std::mutex> lock(queue.mutex);
      queue.ready.wait(lock, [&] { return queue.stopping || !queue.jobs.empty(); });
      if (queue.jobs.empty()) return;
      job = std::move(queue.jobs.front());
      queue.jobs.pop_front();
      ++queue.busy;
    }
    // Note [Renewal when memory is short] (engine/backend.cpp): a killed client's old frames may
    // still hold GPU memory for a moment after it is gone.
    Status status = job.release ? release_slab_now(job.index) : renew_patiently(
        [&] {
          if (which == 1) return renew_slab_now(job.index);
          MEMBAR_RETURN_IF_ERROR(injected_renewal_failure(injected_renewal_failures_));
          return renew_gpu_frame_now(job.index);
        },
        config_.renewal_patience_ms,
        [&] {
          std::lock_guard<std::mutex> lock(queue.mutex);
          return queue.stopping;
        });
    renewals_ += 1;
    job.done(std::move(status));
    {
      std::lock_guard<std::mutex> lock(queue.mutex);
      --queue.busy;
      if (queue.jobs.empty() && queue.busy == 0) queue.idle.notify_all();
    }
  }
}

Status CudaVmmBackend::renew_gpu_frame_now(FrameIndex frame) {
  MEMBAR_RETURN_IF_ERROR(bind_device());
  CUmemAllocationProp properties = {};
  properties.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  properties.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  properties.location.id = context_.device();
  properties.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUdeviceptr address = gpu_reservation_.base() + static_cast<CUdeviceptr>(frame) * kFrameBytes;
  // The old allocation lives on only in processes that kept a descriptor or a mapping of it.
  MEMBAR_RETURN_IF_ERROR(driver_status(api_.get(), gpu_mappings_[frame].unmap(), "cuMemUnmap of a GPU frame"));
  gpu_mappings_[frame] = DeviceMapping();
  gpu_frames_[frame] = PhysicalAllocation();
  CUmemGenericAllocationHandle handle = 0;
  MEMBAR_RETURN_IF_ERROR(driver_status(api_.get(), api_->mem_create(&handle, kFrameBytes, &properties, 0),
                                       "cuMemCreate renewing GPU frame " + std::to_string(frame)));
  gpu_frames_[frame] = PhysicalAllocation(api_.get(), handle);
  MEMBAR_RETURN_IF_ERROR(
      driver_status(api_.get(), api_->cuMemMap(address, kFrameBytes, 0, handle, 0), "cuMemMap of a renewed GPU frame"));
  gpu_mappings_[frame] = DeviceMapping(api_.get(), address, kFrameBytes);
  CUmemAccessDesc access = cuda::device_read_write_access(context_.device());
  MEMBAR_RETURN_IF_ERROR(driver_status(api_.get(), api_->cuMemSetAccess(address, kFrameBytes, &access, 1),
                                       "cuMemSetAccess of a renewed GPU frame"));
  MEMBAR_RETURN_IF_ERROR(runtime_status(
      cudaMemsetAsync(reinterpret_cast<void*>(address), 0, kFrameBytes, renewal_stream_.get()), "cudaMemsetAsync"));
  return runtime_status(cudaStreamSynchronize(renewal_stream_.get()), "cudaStreamSynchronize");
}

Status CudaVmmBackend::renew_slab_now(uint32_t slab) {
  MEMBAR_RETURN_IF_ERROR(bind_device());
  uint64_t bytes = uint64_t(slab_frames_) * kFrameBytes;
  char* address = static_cast<char*>(host_reservation_.get()) + uint64_t(slab) * bytes;
  slab_registrations_[slab].reset();
  MEMBAR_ASSIGN_OR_RETURN(ScopedFd fd, create_sealed_memfd("membar-host-slab", bytes));
  void* mapped = mmap(address, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd.get(), 0);
  if (mapped == MAP_FAILED) return errno_status("mmap of a host slab");
  // Bound to the pool's NUMA node (if any) before any page is touched, then faulted in.
  MEMBAR_RETURN_IF_ERROR(numa::place(address, bytes, numa_node_));
  MEMBAR_RETURN_IF_ERROR(driver_status(api_.get(), api_->cuMemHostRegister(address, bytes, CU_MEMHOSTREGISTER_PORTABLE),
                                       "cuMemHostRegister of a " + std::to_string(bytes >> 20) + " MiB host slab"));
  slab_registrations_[slab] = HostRegistration(api_.get(), address);
  std::lock_guard<std::mutex> lock(slab_mutex_);
  slab_fds_[slab] = std::move(fd);
  return Status::Ok();
}

Status CudaVmmBackend::start() {
  for (auto& stream : copy_streams_) {
    MEMBAR_ASSIGN_OR_RETURN(stream, CudaStream::create());
  }
  MEMBAR_ASSIGN_OR_RETURN(signal_stream_, CudaStream::create());
  for (auto& event : signal_after_) {
    MEMBAR_ASSIGN_OR_RETURN(event, CudaEvent::create());
  }
  for (auto& event : order_after_) {
    MEMBAR_ASSIGN_OR_RETURN(event, CudaEvent::create());
  }
  int mem_ops = 0;
  stream_mem_ops_ = api_->cuDeviceGetAttribute(&mem_ops, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
                                               context_.device()) == CUDA_SUCCESS &&
                    mem_ops != 0;
  if (completion_words_ && stream_mem_ops_) {
    // One word per copy stream in host memory the GPU writes (Note [Completion words]).
    MEMBAR_ASSIGN_OR_RETURN(completion_block_, make_signal_memory("membar-completion", kCopyStreamCount));
  } else {
    completion_words_ = false;
  }
  MEMBAR_ASSIGN_OR_RETURN(zero_source_, DeviceBuffer::create(kFrameBytes));
  MEMBAR_RETURN_IF_ERROR(runtime_status(cudaMemset(zero_source_.get(), 0, kFrameBytes), "cudaMemset"));
  MEMBAR_RETURN_IF_ERROR(runtime_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  MEMBAR_ASSIGN_OR_RETURN(renewal_stream_, CudaStream::create());
  for (int stream = 0; stream < kCopyStreamCount; ++stream) {
    completion_[stream].thread = std::thread([this, stream] { completion_loop(stream); });
  }
  for (int queue = 0; queue < 2; ++queue) {
    for (int t = 0; t < (queue == 0 ? 1 : kSlabThreads); ++t) {
      renewal_[queue].threads.emplace_back([this, queue] { renewal_loop(queue); });
    }
  }
  return Status::Ok();
}

CudaVmmBackend::~CudaVmmBackend() {
  bool started = false;
  for (auto& queue : completion_) started = started || queue.thread.joinable();
  if (started) drain();
  for (auto& queue : completion_) {
    {
      std::lock_guard<std::mutex> lock(queue.mutex);
      queue.stopping = true;
    }
    queue.ready.notify_all();
    if (queue.thread.joinable()) queue.thread.join();
  }
  for (auto& queue : renewal_) {
    {
      std::lock_guard<std::mutex> lock(queue.mutex);
      queue.stopping = true;
    }
    queue.ready.notify_all();
    for (std::thread& thread : queue.threads) {
      if (thread.joinable()) thread.join();
    }
  }
  // Members release in reverse declaration order; make the context current for them.
  if (api_ != nullptr && context_.get() != nullptr) (void)bind_device();
}

char* CudaVmmBackend::pointer(Tier tier, FrameIndex frame) const {
  if (tier == Tier::kGpu) {
    return reinterpret_cast<char*>(gpu_reservation_.base()) + static_cast<uint64_t>(frame) * kFrameBytes;
  }
  return static_cast<char*>(host_reservation_.get()) + static_cast<uint64_t>(frame) * kFrameBytes;
}

void* CudaVmmBackend::frame_pointer(Tier tier, FrameIndex frame) {
  if (tier != Tier::kGpu && tier != Tier::kHost) return nullptr;
  if (frame >= frame_count(tier)) return nullptr;
  return pointer(tier, frame);
}

Status CudaVmmBackend::check_range(Tier tier, FrameIndex frame, uint64_t offset, uint64_t bytes,
                                   const char* what) const {
  if (tier != Tier::kGpu && tier != Tier::kHost) return invalid_argument(std::string(what) + ": unknown tier");
  uint64_t frames = tier == Tier::kGpu ? gpu_frames_.size() : host_frame_count_;
  if (frame >= frames) {
    return out_of_range(std::string(what) + ": " + tier_name(tier) + " frame " + std::to_string(frame) +
                        " does not exist (the pool has " + std::to_string(frames) + ")");
  }
  if (bytes == 0) return invalid_argument(std::string(what) + ": a copy of 0 bytes");
  // A range may run on into the next frames (the pools are contiguous in the daemon's VA),
  // but never past the end of the pool.
  uint64_t start = static_cast<uint64_t>(frame) * kFrameBytes + offset;
  if (offset >= kFrameBytes || bytes > frames * kFrameBytes - start) {
    return out_of_range(std::string(what) + ": offset " + std::to_string(offset) + " + " + std::to_string(bytes) +
                        " bytes in " + tier_name(tier) + " frame " + std::to_string(frame) + " runs past the pool");
  }
  return Status::Ok();
}

Result<int> CudaVmmBackend::export_gpu_frame(FrameIndex frame) {
  MEMBAR_RETURN_IF_ERROR(check_range(Tier::kGpu, frame, 0, 1, "export_gpu_frame"));
  MEMBAR_RETURN_IF_ERROR(bind_device());
  int fd = -1;
  MEMBAR_RETURN_IF_ERROR(driver_status(
      api_.get(),
      api_->cuMemExportToShareableHandle(&fd, gpu_frames_[frame].get(), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
      "cuMemExportToShareableHandle of GPU frame " + std::to_string(frame)));
  return fd;
}

Result<cudaEvent_t> CudaVmmBackend::take_event() {
  if (free_events_.empty()) {
    MEMBAR_ASSIGN_OR_RETURN(CudaEvent event, CudaEvent::create());
    free_events_.push_back(event.get());
    events_.push_back(std::move(event));
  }
  cudaEvent_t event = free_events_.back();
  free_events_.pop_back();
  return event;
}

void CudaVmmBackend::give_event(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_events_.push_back(event);
}

// Note [Completion words]
// Rationale: a batch's completion was a CUDA event recorded after its copies and waited for with
// cudaEventSynchronize on a completion thread. With small batches that costs the thread handing
// copies over ~20 us a batch: on the H200 (runtime_bench (d), session 19) one 2 MiB cudaMemcpyAsync
// took 2.7 us a call alone and 24 us with an event recorded per copy and waited for on another
// thread (25 us when the other thread polled cudaEventQuery instead): the driver calls of the two
// threads slow each other, not the wake-up.
// Approach: each copy stream has a 64-bit word in pinned, device-mapped host memory; after a
// batch's copies the stream writes the stream's next sequence number there
// (cuStreamWriteValue64, in stream order: it lands after the copies before it), and the completion
// thread reads the word from host memory, no driver call, spinning briefly and then sleeping in
// short steps while a part is pending (it sleeps on its queue when none is). Every few hundred
// milliseconds of waiting it asks cudaStreamQuery whether the stream failed, so a device error still
// reaches the batch as its status.
// Limitations: needs 64-bit stream memory operations (events are used where the device lacks
// them, or with MEMBAR_COPY_EVENTS=1 / BackendConfig::completion_words = false); a completion is seen
// up to one sleep step (~20-80 us) after it happened.
Status CudaVmmBackend::wait_completion_word(int stream, uint64_t sequence) {
  const volatile uint64_t* word = static_cast<const volatile uint64_t*>(completion_block_->memory.mapping.get()) + stream;
  auto started = std::chrono::steady_clock::now();
  auto checked = started;
  for (uint32_t spins = 0;; ++spins) {
    if (__atomic_load_n(const_cast<const uint64_t*>(word), __ATOMIC_ACQUIRE) >= sequence) return Status::Ok();
    if (spins < 64) continue;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    auto now = std::chrono::steady_clock::now();
    if (now - checked > std::chrono::milliseconds(250)) {
      checked = now;
      cudaError_t state = cudaStreamQuery(copy_streams_[stream].get());
      if (state != cudaSuccess && state != cudaErrorNotReady) {
        return runtime_status(state, "a transfer on the daemon's copy stream");
      }
    }
  }
}

Status CudaVmmBackend::finish_enqueue(const std::vector<int>& streams, std::function<void(Status)> done) {
  std::vector<uint64_t> sequences;
  if (completion_words_) {
    // A word per stream written after its copies; if a write fails, nothing is queued and `done` is
    // never called (the async contract).
    for (int stream : streams) {
      CUdeviceptr word = completion_block_->device_words + static_cast<CUdeviceptr>(stream) * sizeof(uint64_t);
      uint64_t sequence = completion_sequence_[stream] + 1;
      MEMBAR_RETURN_IF_ERROR(driver_status(
          api_.get(),
          api_->cuStreamWriteValue64(copy_streams_[stream].get(), word, sequence, CU_STREAM_WRITE_VALUE_DEFAULT),
          "cuStreamWriteValue64 of a completion word"));
      completion_sequence_[stream] = sequence;
      sequences.push_back(sequence);
    }
  }
  // Without completion words, record every event before queueing any part: if a record fails,
  // nothing is queued and `done` is never called (the async contract).
  std::vector<cudaEvent_t> events;
  for (size_t i = 0; !completion_words_ && i < streams.size(); ++i) {
    const int stream = streams[i];
    Result<cudaEvent_t> event = take_event();
    Status status = event.ok() ? runtime_status(cudaEventRecord(event.value(), copy_streams_[stream].get()),
                                                "cudaEventRecord on a copy stream")
                               : event.status();
    if (event.ok()) events.push_back(event.value());
    if (!status.ok()) {
      for (cudaEvent_t unused : events) free_events_.push_back(unused);
      return status;
    }
  }
  auto batch = std::make_shared<Batch>();
  batch->parts_left = static_cast<int>(streams.size());
  batch->done = std::move(done);
  {
    std::lock_guard<std::mutex> lock(outstanding_mutex_);
    ++outstanding_batches_;
  }
  for (size_t part = 0; part < streams.size(); ++part) {
    CompletionQueue& queue = completion_[streams[part]];
    bool was_empty = false;
    {
      std::lock_guard<std::mutex> lock(queue.mutex);
      was_empty = queue.parts.empty();
      queue.parts.push_back(completion_words_ ? PendingPart{nullptr, sequences[part], batch}
                                              : PendingPart{events[part], 0, batch});
    }
    // A part leaves its queue only once the completion thread has finished it, and the thread
    // sleeps only on an empty queue: only a part into an empty queue needs to wake it (a wake is a
    // system call on the thread that hands copies over, once per batch otherwise).
    if (was_empty) queue.ready.notify_one();
  }
  return Status::Ok();
}

// Note [Device-ordered copies] in engine/batches.cpp: a stream waits for the other copy stream's
// work so far through an event, and for a client's release marker with cuStreamWaitValue64 on
// the word's device mapping; neither takes a host thread once enqueued.
Status CudaVmmBackend::apply_order(int stream, const DeviceOrder& order) {
  if (order.after_enqueued) {
    for (int other = 0; other < kCopyStreamCount; ++other) {
      if (other == stream) continue;   // a stream runs its own work in order
      MEMBAR_RETURN_IF_ERROR(runtime_status(cudaEventRecord(order_after_[other].get(), copy_streams_[other].get()),
                                            "cudaEventRecord for an ordered batch"));
      MEMBAR_RETURN_IF_ERROR(runtime_status(
          cudaStreamWaitEvent(copy_streams_[stream].get(), order_after_[other].get(), 0),
          "cudaStreamWaitEvent for an ordered batch"));
    }
  }
  if (order.wait_value != 0) {
    MEMBAR_ASSIGN_OR_RETURN(CUdeviceptr word, signal_word_address(order.wait_block, order.wait_index));
    MEMBAR_RETURN_IF_ERROR(driver_status(api_.get(),
                                         api_->cuStreamWaitValue64(copy_streams_[stream].get(), word, order.wait_value,
                                                                   CU_STREAM_WAIT_VALUE_GEQ),
                                         "cuStreamWaitValue64 on a release marker"));
  }
  return Status::Ok();
}

// Note [Copies handed over in one call]
// Rationale: the offloaded 7B step at 128K hands ~326K frame copies to the driver, and the
// trainer's thread spent 10.9 s doing it (session 16) while cudaMemcpyAsync alone measured ~5 us a
// call (bench/probes/enqueue_probe.py): per-call driver work (pointer lookups of VMM and
// registered memory, stream bookkeeping) repeated for every 2 MiB copy of a batch whose copies
// are all independent (the engine never puts two ops on one frame in a batch).
// Approach: after merging, one stream's transfers of a batch go to the driver in one
// cudaMemcpyBatchAsync call (CUDA 12.8+; one attribute set: source read in stream order), which
// runs them in stream order as a whole and in any order among themselves. A single transfer keeps
// cudaMemcpyAsync. If the first batched call fails with "not supported" or "invalid value" (a
// driver or platform without it), the backend says so once on stderr and hands copies over one by
// one from then on; once a batched call has worked, any later error is the copy's error.
// BackendConfig::batch_copies = false or MEMBAR_BATCH_COPIES=0 turns it off (to compare).
Status CudaVmmBackend::issue_transfers(int stream, const std::vector<Transfer>& transfers) {
  cudaStream_t copy_stream = copy_streams_[stream].get();
  transfers_ += transfers.size();
  if (batch_copies_ && transfers.size() > 1) {
    batch_destinations_.clear();
    batch_sources_.clear();
    batch_sizes_.clear();
    for (const Transfer& transfer : transfers) {
      batch_destinations_.push_back(transfer.destination);
      batch_sources_.push_back(transfer.source);
      batch_sizes_.push_back(transfer.bytes);
    }
    cudaMemcpyAttributes attributes = {};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t first_copy = 0;
    cudaError_t error = cudaMemcpyBatchAsync(batch_destinations_.data(), batch_sources_.data(), batch_sizes_.data(),
                                             transfers.size(), &attributes, &first_copy, 1, copy_stream);
    if (error == cudaSuccess) {
      batch_copies_worked_ = true;
      return Status::Ok();
    }
    if (batch_copies_worked_ || (error != cudaErrorNotSupported && error != cudaErrorInvalidValue)) {
      return runtime_status(error, "cudaMemcpyBatchAsync on a copy stream");
    }
    (void)cudaGetLastError();
    batch_copies_ = false;
    std::fprintf(stderr, "membar: cudaMemcpyBatchAsync is not usable here (%s); copies go to the driver one by one\n",
                 cudaGetErrorString(error));
  }
  for (const Transfer& transfer : transfers) {
    MEMBAR_RETURN_IF_ERROR(runtime_status(
        cudaMemcpyAsync(transfer.destination, transfer.source, transfer.bytes, cudaMemcpyDefault, copy_stream),
        "cudaMemcpyAsync on a copy stream"));
  }
  return Status::Ok();
}

Status CudaVmmBackend::enqueue_copies(std::vector<CopyOp> ops, std::function<void(Status)> done,
                                      const DeviceOrder& order) {
  if (!done) return invalid_argument("enqueue_copies needs a completion callback");
  copy_ops_ += ops.size();
  for (const CopyOp& op : ops) bytes_copied_ += op.bytes;
  std::vector<Transfer> by_stream[kCopyStreamCount];
  for (const CopyOp& op : ops) {
    MEMBAR_RETURN_IF_ERROR(check_range(op.src_tier, op.src_frame, op.src_offset, op.bytes, "copy source"));
    MEMBAR_RETURN_IF_ERROR(check_range(op.dst_tier, op.dst_frame, op.dst_offset, op.bytes, "copy destination"));
    // Into the GPU (from the host, or GPU-to-GPU: copy_pages from pages still resident) on one
    // stream, out of it (and host-to-host) on the other: a copy into staging rows must not queue
    // behind write-backs that wait for the trainer's release markers.
    int stream = op.dst_tier == Tier::kGpu ? kHostToDevice : kDeviceToHost;
    by_stream[stream].push_back(Transfer{pointer(op.src_tier, op.src_frame) + op.src_offset,
                                         pointer(op.dst_tier, op.dst_frame) + op.dst_offset, op.bytes});
  }
  // Merge (Note [CUDA frames and copies]); no transfer may cross a slab boundary: each must
  // stay inside one pinned region.
  for (auto& transfers : by_stream) {
    copy_plan_merge(transfers);
    char* host_begin = static_cast<char*>(host_reservation_.get());
    if (host_begin != nullptr) {
      copy_plan_split(transfers, host_begin, host_begin + host_reservation_.bytes(), uint64_t(slab_frames_) * kFrameBytes);
    }
  }

  MEMBAR_RETURN_IF_ERROR(bind_device());
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int> streams;
  for (int stream = 0; stream < kCopyStreamCount; ++stream) {
    if (by_stream[stream].empty()) continue;
    MEMBAR_RETURN_IF_ERROR(apply_order(stream, order));
    MEMBAR_RETURN_IF_ERROR(issue_transfers(stream, by_stream[stream]));
    streams.push_back(stream);
  }
  // An empty batch still completes once, from a backend thread, in stream order (after what its
  // order names).
  if (streams.empty()) {
    MEMBAR_RETURN_IF_ERROR(apply_order(kHostToDevice, order));
    streams.push_back(kHostToDevice);
  }
  return finish_enqueue(streams, std::move(done));
}

Status CudaVmmBackend::enqueue_zero(Tier tier, FrameIndex frame, uint64_t offset, uint64_t bytes,
                                    std::function<void(Status)> done, const DeviceOrder& order) {
  if (!done) return invalid_argument("enqueue_zero needs a completion callback");
  ++zero_fills_;
  MEMBAR_RETURN_IF_ERROR(check_range(tier, frame, offset, bytes, "zero fill"));
  MEMBAR_RETURN_IF_ERROR(bind_device());
  char* target = pointer(tier, frame) + offset;
  std::lock_guard<std::mutex> lock(mutex_);
  MEMBAR_RETURN_IF_ERROR(apply_order(tier == Tier::kGpu ? kHostToDevice : kDeviceToHost, order));
  if (tier == Tier::kGpu) {
    // GPU frames fill on the GPU, on the stream that brings pages in.
    MEMBAR_RETURN_IF_ERROR(runtime_status(cudaMemsetAsync(target, 0, bytes, copy_streams_[kHostToDevice].get()),
                                          "cudaMemsetAsync of a GPU range"));
    return finish_enqueue({kHostToDevice}, std::move(done));
  }
  // Host frames fill by DMA from a zeroed device buffer, in stream order with offloads.
  // Pieces end at frame boundaries: at most one frame of zeros each, inside one registration.
  for (uint64_t filled = 0; filled < bytes;) {
    uint64_t into_frame = (offset + filled) % kFrameBytes;
    uint64_t piece = std::min<uint64_t>(kFrameBytes - into_frame, bytes - filled);
    MEMBAR_RETURN_IF_ERROR(runtime_status(cudaMemcpyAsync(target + filled, zero_source_.get(), piece,
                                                          cudaMemcpyDeviceToHost, copy_streams_[kDeviceToHost].get()),
                                          "cudaMemcpyAsync zero fill of a host range"));
    filled += piece;
  }
  return finish_enqueue({kDeviceToHost}, std::move(done));
}

void CudaVmmBackend::completion_loop(int stream) {
  (void)bind_device();
  CompletionQueue& queue = completion_[stream];
  while (true) {
    PendingPart part;
    {
      std::unique_lock<std::mutex> lock(queue.mutex);
      queue.ready.wait(lock, [&] { return queue.stopping || !queue.parts.empty(); });
      if (queue.parts.empty()) return;  // stopping, and nothing left
      part = queue.parts.front();       // stays queued until finished (finish_enqueue's wake)
    }
    Status status;
    if (part.event == nullptr) {
      status = wait_completion_word(stream, part.sequence);
    } else {
      status = runtime_status(cudaEventSynchronize(part.event), "a transfer on the daemon's copy stream");
      give_event(part.event);
    }
    finish_part(part.batch, std::move(status));
    part.batch.reset();
    std::lock_guard<std::mutex> lock(queue.mutex);
    queue.parts.pop_front();
  }
}

void CudaVmmBackend::finish_part(const std::shared_ptr<Batch>& batch, Status status) {
  if (!status.ok()) {
    std::lock_guard<std::mutex> lock(batch->mutex);
    if (batch->status.ok()) batch->status = std::move(status);
  }
  if (batch->parts_left.fetch_sub(1) != 1) return;
  Status final_status;
  {
    std::lock_guard<std::mutex> lock(batch->mutex);
    final_status = batch->status;
  }
  batch->done(std::move(final_status));
  batch->done = nullptr;  // drop captured state now, not when the last shared_ptr goes
  {
    std::lock_guard<std::mutex> lock(outstanding_mutex_);
    --outstanding_batches_;
  }
  outstanding_zero_.notify_all();
}

void CudaVmmBackend::drain() {
  {
    std::unique_lock<std::mutex> lock(outstanding_mutex_);
    outstanding_zero_.wait(lock, [&] { return outstanding_batches_ == 0; });
  }
  for (auto& queue : renewal_) {
    std::unique_lock<std::mutex> lock(queue.mutex);
    queue.idle.wait(lock, [&] { return queue.jobs.empty() && queue.busy == 0; });
  }
  if (bind_device().ok()) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (signal_stream_.get() != nullptr) (void)cudaStreamSynchronize(signal_stream_.get());
  }
}

Result<std::unique_ptr<SignalBlock>> CudaVmmBackend::make_signal_memory(const char* name, uint32_t words) {
  uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t bytes = (static_cast<uint64_t>(words) * sizeof(uint64_t) + page - 1) / page * page;
  auto block = std::make_unique<SignalBlock>();
  MEMBAR_ASSIGN_OR_RETURN(block->memory, create_shared_memory(name, bytes));
  void* words_pointer = block->memory.mapping.get();
  MEMBAR_RETURN_IF_ERROR(driver_status(
      api_.get(),
      api_->cuMemHostRegister(words_pointer, bytes, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP),
      std::string("cuMemHostRegister of ") + name));
  block->registration = HostRegistration(api_.get(), words_pointer);
  MEMBAR_RETURN_IF_ERROR(driver_status(api_.get(),
                                       api_->cuMemHostGetDevicePointer(&block->device_words, words_pointer, 0),
                                       std::string("cuMemHostGetDevicePointer of ") + name));
  block->words = words;
  return block;
}

Result<uint32_t> CudaVmmBackend::create_signal_block(uint32_t words) {
  if (words == 0 || words > kMaxSignalWords) {
    return invalid_argument("a signal block has 1.." + std::to_string(kMaxSignalWords) + " words, not " +
                            std::to_string(words));
  }
  MEMBAR_RETURN_IF_ERROR(bind_device());
  MEMBAR_ASSIGN_OR_RETURN(std::unique_ptr<SignalBlock> block, make_signal_memory("membar-signals", words));
  std::lock_guard<std::mutex> lock(mutex_);
  uint32_t id = next_signal_block_++;
  signal_blocks_.emplace(id, std::move(block));
  return id;
}

Status CudaVmmBackend::destroy_signal_block(uint32_t block) {
  MEMBAR_RETURN_IF_ERROR(bind_device());
  std::unique_ptr<SignalBlock> doomed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = signal_blocks_.find(block);
    if (found == signal_blocks_.end()) return not_found("signal block " + std::to_string(block) + " does not exist");
    // Writes already enqueued for this block must land before its memory goes away.
    MEMBAR_RETURN_IF_ERROR(runtime_status(cudaStreamSynchronize(signal_stream_.get()), "cudaStreamSynchronize"));
    doomed = std::move(found->second);
    signal_blocks_.erase(found);
  }
  return Status::Ok();
}

Result<int> CudaVmmBackend::export_signal_block(uint32_t block) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = signal_blocks_.find(block);
  if (found == signal_blocks_.end()) return not_found("signal block " + std::to_string(block) + " does not exist");
  int fd = fcntl(found->second->memory.fd.get(), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return errno_status("duplicating a signal block's fd");
  return fd;
}

volatile uint64_t* CudaVmmBackend::signal_words(uint32_t block) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = signal_blocks_.find(block);
  if (found == signal_blocks_.end()) return nullptr;
  return static_cast<volatile uint64_t*>(found->second->memory.mapping.get());
}

Result<CUdeviceptr> CudaVmmBackend::signal_word_address(uint32_t block, uint32_t index) const {
  auto found = signal_blocks_.find(block);
  if (found == signal_blocks_.end()) return not_found("signal block " + std::to_string(block) + " does not exist");
  if (index >= found->second->words) {
    return out_of_range("signal word " + std::to_string(index) + " is past the block's " +
                        std::to_string(found->second->words) + " words");
  }
  return found->second->device_words + static_cast<CUdeviceptr>(index) * sizeof(uint64_t);
}

Status CudaVmmBackend::enqueue_signal(uint32_t block, uint32_t index, uint64_t value) {
  MEMBAR_RETURN_IF_ERROR(bind_device());
  std::lock_guard<std::mutex> lock(mutex_);
  MEMBAR_ASSIGN_OR_RETURN(CUdeviceptr word, signal_word_address(block, index));
  // The signal stream waits for everything enqueued so far on both copy streams, then writes:
  // a signal never makes a copy stream wait.
  for (int stream = 0; stream < kCopyStreamCount; ++stream) {
    MEMBAR_RETURN_IF_ERROR(runtime_status(cudaEventRecord(signal_after_[stream].get(), copy_streams_[stream].get()),
                                          "cudaEventRecord before a signal"));
    MEMBAR_RETURN_IF_ERROR(runtime_status(cudaStreamWaitEvent(signal_stream_.get(), signal_after_[stream].get(), 0),
                                          "cudaStreamWaitEvent before a signal"));
  }
  return driver_status(api_.get(),
                       api_->cuStreamWriteValue64(signal_stream_.get(), word, value, CU_STREAM_WRITE_VALUE_DEFAULT),
                       "cuStreamWriteValue64 of a signal word");
}

}  // namespace

Result<std::unique_ptr<DeviceBackend>> make_cuda_backend(const BackendConfig& config) {
  return CudaVmmBackend::create(config);
}

}  // namespace membar::runtimed
