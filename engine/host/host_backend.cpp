// HostBackend: the DeviceBackend with no GPU (Note [Frames, slabs and renewal] in
// engine/frames.cpp). Each tier is one contiguous reservation of this process's address space:
// frame i of a tier lives at tier_base + i * kFrameBytes, which lets adjacent CopyOps that cross a
// frame boundary merge into one memcpy. A "GPU" frame gets its memory (a memfd of its own, mapped
// over its place in the reservation) when it is exported to a client, and loses it when it is
// renewed, so no descriptor is kept per frame and a client's old descriptor never reaches a later
// owner's bytes. A host slab is one memfd mapped over its place, replaced by a new one at each
// renewal. Copies, zero fills and renewals run on worker threads; signal blocks are memfds too.
#include <sys/mman.h>
#include <unistd.h>
#include <fcntl.h>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "membar/common/fd.h"
#include "membar/engine/backend.h"
#include "membar/engine/numa.h"

namespace membar::runtimed {
namespace {

std::string errno_text(int error) { return std::string(std::strerror(error)); }


// An owned mapping (munmap on destruction).
class UniqueMapping {
 public:
  UniqueMapping() = default;
  UniqueMapping(void* base, size_t bytes) : base_(base), bytes_(bytes) {}
  UniqueMapping(UniqueMapping&& other) noexcept
      : base_(std::exchange(other.base_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  UniqueMapping& operator=(UniqueMapping&& other) noexcept {
    if (this != &other) {
      reset();
      base_ = std::exchange(other.base_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  UniqueMapping(const UniqueMapping&) = delete;
  UniqueMapping& operator=(const UniqueMapping&) = delete;
  ~UniqueMapping() { reset(); }
  char* get() const { return static_cast<char*>(base_); }
  void reset() {
    if (base_ != nullptr) ::munmap(base_, bytes_);
    base_ = nullptr;
    bytes_ = 0;
  }

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
};

Result<UniqueFd> make_memfd(const char* name, uint64_t bytes) {
  int fd = ::memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) {
    int error = errno;
    if (error == EMFILE || error == ENFILE) {
      return resource_exhausted("memfd_create failed: out of file descriptors (" +
                                errno_text(error) + "); raise the open-file limit (ulimit -n)");
    }
    return internal_error("memfd_create failed: " + errno_text(error));
  }
  UniqueFd owned(fd);
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return resource_exhausted("ftruncate of a " + std::to_string(bytes) +
                              "-byte memfd failed: " + errno_text(errno));
  }
  return owned;
}

// One tier's frames, all in one contiguous reservation.
struct TierPool {
  UniqueMapping reservation;  // [frame_count * kFrameBytes]
  uint64_t frame_count = 0;
  char* base() const { return reservation.get(); }
};

struct SignalBlock {
  UniqueFd fd;
  UniqueMapping mapping;
  uint32_t words = 0;
};

// A unit of work for the copy threads.
struct Job {
  uint64_t sequence = 0;
  // Merged copies: (source, destination, bytes) in this process's address space.
  struct Transfer {
    char* source;
    char* destination;
    uint64_t bytes;
  };
  std::vector<Transfer> transfers;
  bool zero = false;  // transfers[i].source unused: fill destination with zeros
  // A renewal instead of transfers (Note [Frames, slabs and renewal]).
  std::function<Status()> renew;
  std::function<void(Status)> done;
  DeviceOrder order;   // Note [Device-ordered copies]: what the job waits for before it runs
};

struct PendingSignal {
  uint64_t sequence;  // fires once every job with a smaller sequence has completed
  uint32_t block;
  uint32_t index;
  uint64_t value;
};

class HostBackend final : public DeviceBackend {
 public:
  explicit HostBackend(const BackendConfig& config) : config_(config) {}

  ~HostBackend() override {
    drain();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    work_ready_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

  Status init() {
    injected_renewal_failures_ = static_cast<int64_t>(config_.fail_renewal_attempts);
    // No GPU to be near: only a node named explicitly places the pool.
    MEMBAR_ASSIGN_OR_RETURN(numa_node_, numa::resolve_node(config_.host_numa_node, numa::kNoPlacement, &numa_note_));
    slab_frames_ = config_.host_slab_frames != 0 ? config_.host_slab_frames
                                                  : host_slab_frames_for(config_.host_pool_bytes);
    uint64_t host_frames = config_.host_pool_bytes / kFrameBytes / slab_frames_ * slab_frames_;
    MEMBAR_RETURN_IF_ERROR(reserve_tier(Tier::kGpu, config_.gpu_pool_bytes / kFrameBytes));
    MEMBAR_RETURN_IF_ERROR(reserve_tier(Tier::kHost, host_frames));
    slab_fds_.resize(host_frames / slab_frames_);
    constexpr int kWorkerCount = 2;
    for (int i = 0; i < kWorkerCount; ++i) workers_.emplace_back([this] { worker_loop(); });
    return Status::Ok();
  }

  std::string name() const override { return "host"; }
  int host_numa_node() const override { return numa_node_; }
  std::string host_numa_note() const override { return numa_note_; }

  uint64_t frame_count(Tier tier) const override { return pool(tier).frame_count; }
  uint32_t host_slab_frames() const override { return slab_frames_; }

  Result<int> export_gpu_frame(FrameIndex frame) override {
    MEMBAR_RETURN_IF_ERROR(check_range(Tier::kGpu, frame, 0, kFrameBytes));
    // Fresh memory for each export: the frame had none since its renewal (or ever).
    MEMBAR_ASSIGN_OR_RETURN(UniqueFd fd, make_memfd("membar-gpu-frame", kFrameBytes));
    void* at = ::mmap(gpu_.base() + uint64_t(frame) * kFrameBytes, kFrameBytes, PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_FIXED, fd.get(), 0);
    if (at == MAP_FAILED) return resource_exhausted("mapping a GPU-tier frame failed: " + errno_text(errno));
    return fd.release();
  }

  Result<int> export_host_slab(uint32_t slab) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (slab >= slab_fds_.size() || !slab_fds_[slab].valid()) {
      return failed_precondition("host slab " + std::to_string(slab) + " is not prepared");
    }
    int fd = ::fcntl(slab_fds_[slab].get(), F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return resource_exhausted("dup of a slab fd failed: " + errno_text(errno));
    return fd;
  }

  Status renew(Tier tier, uint32_t index, std::function<void(Status)> done) override {
    if (tier == Tier::kGpu) {
      MEMBAR_RETURN_IF_ERROR(check_range(Tier::kGpu, index, 0, kFrameBytes));
    } else if (index >= slab_fds_.size()) {
      return out_of_range("host slab " + std::to_string(index) + " does not exist");
    }
    Job job;
    job.done = std::move(done);
    job.renew = [this, tier, index]() -> Status {
      return renew_patiently([&] { return renew_now(tier, index); }, config_.renewal_patience_ms,
                             [this] { return stopping(); });
    };
    counters_renewals_ += 1;
    submit(std::move(job));
    return Status::Ok();
  }

  Status release_host_slab(uint32_t slab, std::function<void(Status)> done) override {
    if (slab >= slab_fds_.size()) return out_of_range("host slab " + std::to_string(slab) + " does not exist");
    Job job;
    job.done = std::move(done);
    job.renew = [this, slab]() -> Status {
      uint64_t bytes = uint64_t(slab_frames_) * kFrameBytes;
      void* at = ::mmap(host_.base() + uint64_t(slab) * bytes, bytes, PROT_NONE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
      if (at == MAP_FAILED) return internal_error("dropping a host slab failed: " + errno_text(errno));
      std::lock_guard<std::mutex> lock(mutex_);
      slab_fds_[slab] = UniqueFd();
      return Status::Ok();
    };
    submit(std::move(job));
    return Status::Ok();
  }

  // One try at a renewal (Note [Renewal when memory is short] in engine/backend.cpp).
  Status renew_now(Tier tier, uint32_t index) {
    if (tier == Tier::kGpu) {
      MEMBAR_RETURN_IF_ERROR(injected_renewal_failure(injected_renewal_failures_));
      // Drop the memory: the next export makes new memory.
      void* at = ::mmap(gpu_.base() + uint64_t(index) * kFrameBytes, kFrameBytes, PROT_NONE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
      if (at == MAP_FAILED) return internal_error("dropping a GPU-tier frame failed: " + errno_text(errno));
      return Status::Ok();
    }
    uint64_t bytes = uint64_t(slab_frames_) * kFrameBytes;
    MEMBAR_ASSIGN_OR_RETURN(UniqueFd fd, make_memfd("membar-host-slab", bytes));
    void* at = ::mmap(host_.base() + uint64_t(index) * bytes, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                      fd.get(), 0);
    if (at == MAP_FAILED) return resource_exhausted("mapping a host slab failed: " + errno_text(errno));
    if (numa_node_ >= 0) MEMBAR_RETURN_IF_ERROR(numa::place(at, bytes, numa_node_));
    std::lock_guard<std::mutex> lock(mutex_);
    slab_fds_[index] = std::move(fd);
    return Status::Ok();
  }

  bool stopping() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stopping_;
  }

  void* frame_pointer(Tier tier, FrameIndex frame) override {
    if (frame >= frame_count(tier)) return nullptr;
    return pool(tier).base() + uint64_t(frame) * kFrameBytes;
  }

  // Jobs run on two workers in any order unless a DeviceOrder says otherwise: after_enqueued
  // waits for every earlier job, wait_value polls the signal word (the stand-in for a stream's
  // release marker on a machine without a GPU).
  bool orders_on_device() const override { return true; }

  Status enqueue_copies(std::vector<CopyOp> ops, std::function<void(Status)> done,
                        const DeviceOrder& order) override {
    MEMBAR_RETURN_IF_ERROR(check_order(order));
    for (const CopyOp& op : ops) {
      MEMBAR_RETURN_IF_ERROR(check_range(op.src_tier, op.src_frame, op.src_offset, op.bytes));
      MEMBAR_RETURN_IF_ERROR(check_range(op.dst_tier, op.dst_frame, op.dst_offset, op.bytes));
    }
    // Sort by source address, then merge runs whose sources and destinations both continue
    // where the previous op ended (frames of a tier are contiguous here, so runs may cross
    // frame boundaries).
    auto address = [this](Tier tier, FrameIndex frame, uint64_t offset) {
      return pool(tier).base() + uint64_t(frame) * kFrameBytes + offset;
    };
    std::sort(ops.begin(), ops.end(), [&](const CopyOp& a, const CopyOp& b) {
      return address(a.src_tier, a.src_frame, a.src_offset) <
             address(b.src_tier, b.src_frame, b.src_offset);
    });
    Job job;
    job.done = std::move(done);
    job.order = order;
    uint64_t bytes = 0;
    for (const CopyOp& op : ops) {
      if (op.bytes == 0) continue;
      char* source = address(op.src_tier, op.src_frame, op.src_offset);
      char* destination = address(op.dst_tier, op.dst_frame, op.dst_offset);
      bytes += op.bytes;
      if (!job.transfers.empty()) {
        Job::Transfer& last = job.transfers.back();
        if (last.source + last.bytes == source && last.destination + last.bytes == destination) {
          last.bytes += op.bytes;
          continue;
        }
      }
      job.transfers.push_back({source, destination, op.bytes});
    }
    counters_copy_ops_ += ops.size();
    counters_transfers_ += job.transfers.size();
    counters_bytes_ += bytes;
    submit(std::move(job));
    return Status::Ok();
  }

  Status enqueue_zero(Tier tier, FrameIndex frame, uint64_t offset, uint64_t bytes, std::function<void(Status)> done,
                      const DeviceOrder& order) override {
    MEMBAR_RETURN_IF_ERROR(check_range(tier, frame, offset, bytes));
    MEMBAR_RETURN_IF_ERROR(check_order(order));
    Job job;
    job.zero = true;
    job.done = std::move(done);
    job.order = order;
    job.transfers.push_back({nullptr, pool(tier).base() + uint64_t(frame) * kFrameBytes + offset, bytes});
    counters_zero_fills_ += 1;
    submit(std::move(job));
    return Status::Ok();
  }

  void drain() override {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [this] { return queue_.empty() && outstanding_.empty(); });
  }

  Result<uint32_t> create_signal_block(uint32_t words) override {
    if (words == 0 || words > 4096) {
      return invalid_argument("a signal block holds 1 to 4096 words, not " + std::to_string(words));
    }
    uint64_t bytes = (uint64_t(words) * sizeof(uint64_t) + 4095) & ~uint64_t(4095);
    MEMBAR_ASSIGN_OR_RETURN(UniqueFd fd, make_memfd("membar-signals", bytes));
    void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (base == MAP_FAILED) return resource_exhausted("mmap of a signal block failed: " + errno_text(errno));
    SignalBlock block{std::move(fd), UniqueMapping(base, bytes), words};
    std::lock_guard<std::mutex> lock(mutex_);
    uint32_t id = next_signal_block_++;
    signal_blocks_.emplace(id, std::move(block));
    return id;
  }

  Status destroy_signal_block(uint32_t block) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (signal_blocks_.erase(block) == 0) {
      return not_found("signal block " + std::to_string(block) + " does not exist");
    }
    return Status::Ok();
  }

  Result<int> export_signal_block(uint32_t block) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = signal_blocks_.find(block);
    if (it == signal_blocks_.end()) return not_found("signal block " + std::to_string(block) + " does not exist");
    int fd = ::fcntl(it->second.fd.get(), F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return resource_exhausted("dup of a signal block fd failed: " + errno_text(errno));
    return fd;
  }

  volatile uint64_t* signal_words(uint32_t block) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = signal_blocks_.find(block);
    if (it == signal_blocks_.end()) return nullptr;
    return reinterpret_cast<volatile uint64_t*>(it->second.mapping.get());
  }

  Status enqueue_signal(uint32_t block, uint32_t index, uint64_t value) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_RETURN_IF_ERROR(signal_word_locked(block, index).status());
    pending_signals_.push_back({next_sequence_, block, index, value});
    fire_ready_signals_locked();
    return Status::Ok();
  }

  BackendCounters counters() const override {
    return {counters_copy_ops_.load(), counters_transfers_.load(), counters_bytes_.load(),
            counters_zero_fills_.load(), counters_renewals_.load()};
  }

 private:
  static std::string tier_name(Tier tier) { return tier == Tier::kGpu ? "GPU" : "host"; }

  const TierPool& pool(Tier tier) const { return tier == Tier::kGpu ? gpu_ : host_; }
  TierPool& pool(Tier tier) { return tier == Tier::kGpu ? gpu_ : host_; }

  Status reserve_tier(Tier tier, uint64_t count) {
    TierPool& target = pool(tier);
    target.frame_count = count;
    if (count == 0) return Status::Ok();
    if (tier == Tier::kGpu && config_.fail_frame_create_after != 0 && config_.fail_frame_create_after <= count) {
      return resource_exhausted("creating GPU frame " + std::to_string(config_.fail_frame_create_after) +
                                " failed (fault injected by BackendConfig::fail_frame_create_after)");
    }
    uint64_t bytes = count * kFrameBytes;
    void* base = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) {
      return resource_exhausted("reserving " + std::to_string(bytes) + " bytes of address space for the " +
                                tier_name(tier) + " pool failed: " + errno_text(errno));
    }
    target.reservation = UniqueMapping(base, bytes);
    return Status::Ok();
  }

  // Word `index` of signal block `block` (caller holds mutex_).
  Result<uint64_t*> signal_word_locked(uint32_t block, uint32_t index) {
    auto it = signal_blocks_.find(block);
    if (it == signal_blocks_.end()) return not_found("signal block " + std::to_string(block) + " does not exist");
    if (index >= it->second.words) {
      return out_of_range("signal word " + std::to_string(index) + " is outside a block of " +
                          std::to_string(it->second.words) + " words");
    }
    return reinterpret_cast<uint64_t*>(it->second.mapping.get()) + index;
  }

  Status check_order(const DeviceOrder& order) {
    if (order.wait_value == 0) return Status::Ok();
    std::lock_guard<std::mutex> lock(mutex_);
    return signal_word_locked(order.wait_block, order.wait_index).status();
  }

  Status check_range(Tier tier, FrameIndex frame, uint64_t offset, uint64_t bytes) const {
    if (frame >= frame_count(tier)) {
      return out_of_range("frame " + std::to_string(frame) + " is outside the " + tier_name(tier) +
                          " pool of " + std::to_string(frame_count(tier)) + " frames");
    }
    if (offset > kFrameBytes || bytes > kFrameBytes - offset) {
      return out_of_range("bytes [" + std::to_string(offset) + ", " + std::to_string(offset + bytes) +
                          ") do not fit in a 2 MiB frame");
    }
    return Status::Ok();
  }

  void submit(Job job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job.sequence = next_sequence_++;
      outstanding_.insert(job.sequence);
      queue_.push_back(std::move(job));
    }
    work_ready_.notify_one();
  }

  void worker_loop() {
    for (;;) {
      Job job;
      uint64_t* word = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        work_ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
        // Every earlier job was taken by a worker before this one, so this wait ends.
        if (job.order.after_enqueued) {
          progress_.wait(lock, [&] { return *outstanding_.begin() == job.sequence; });
        }
        if (job.order.wait_value != 0) {
          Result<uint64_t*> found = signal_word_locked(job.order.wait_block, job.order.wait_index);
          if (found.ok()) word = found.value();
        }
      }
      Status status = job.renew ? job.renew() : Status::Ok();
      if (job.order.wait_value != 0 && word == nullptr) {
        status = failed_precondition("the signal block a copy waits on is gone");
        job.transfers.clear();
      }
      // A signal block outlives the jobs that wait on it (the engine drains them first).
      while (word != nullptr && __atomic_load_n(word, __ATOMIC_ACQUIRE) < job.order.wait_value) {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      for (const Job::Transfer& transfer : job.transfers) {
        if (job.zero) {
          std::memset(transfer.destination, 0, transfer.bytes);
        } else {
          std::memmove(transfer.destination, transfer.source, transfer.bytes);
        }
      }
      if (job.done) job.done(status);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        outstanding_.erase(job.sequence);
        fire_ready_signals_locked();
        progress_.notify_all();
        if (queue_.empty() && outstanding_.empty()) idle_.notify_all();
      }
    }
  }

  // Writes every pending signal whose preceding jobs have all completed.
  void fire_ready_signals_locked() {
    uint64_t oldest = outstanding_.empty() ? UINT64_MAX : *outstanding_.begin();
    auto ready = [oldest](const PendingSignal& s) { return s.sequence <= oldest; };
    for (const PendingSignal& signal : pending_signals_) {
      if (!ready(signal)) continue;
      auto it = signal_blocks_.find(signal.block);
      if (it == signal_blocks_.end()) continue;
      // A release store: whoever reads the word also sees every byte the copies wrote.
      __atomic_store_n(reinterpret_cast<uint64_t*>(it->second.mapping.get()) + signal.index, signal.value,
                       __ATOMIC_RELEASE);
    }
    pending_signals_.erase(std::remove_if(pending_signals_.begin(), pending_signals_.end(), ready),
                           pending_signals_.end());
  }

  BackendConfig config_;
  TierPool gpu_;
  TierPool host_;
  uint32_t slab_frames_ = 1;
  std::atomic<int64_t> injected_renewal_failures_{0};
  std::vector<UniqueFd> slab_fds_;  // guarded by mutex_; valid once a slab is prepared
  int numa_node_ = numa::kNoPlacement;   // Note [Host pools near their GPU]
  std::string numa_note_;

  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable idle_;
  std::condition_variable progress_;   // a job completed (after_enqueued waits)
  std::deque<Job> queue_;
  std::set<uint64_t> outstanding_;  // sequences of queued or running jobs
  std::vector<PendingSignal> pending_signals_;
  uint64_t next_sequence_ = 1;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
  std::map<uint32_t, SignalBlock> signal_blocks_;
  uint32_t next_signal_block_ = 1;

  std::atomic<uint64_t> counters_copy_ops_{0};
  std::atomic<uint64_t> counters_transfers_{0};
  std::atomic<uint64_t> counters_bytes_{0};
  std::atomic<uint64_t> counters_zero_fills_{0};
  std::atomic<uint64_t> counters_renewals_{0};
};

}  // namespace

Result<std::unique_ptr<DeviceBackend>> make_host_backend(const BackendConfig& config) {
  auto backend = std::make_unique<HostBackend>(config);
  MEMBAR_RETURN_IF_ERROR(backend->init());
  return std::unique_ptr<DeviceBackend>(std::move(backend));
}

}  // namespace membar::runtimed
