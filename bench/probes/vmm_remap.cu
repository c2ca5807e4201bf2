// Probe: what remapping CUDA VMM frames costs on the trainer's side, to choose how a space's
// pages reach a contiguous virtual layout (issue "One memory system"). Measures, on one GPU:
//   1. cuMemMap / cuMemSetAccess / cuMemUnmap per 2 MiB frame, one call per frame and batched
//      (one cuMemSetAccess / cuMemUnmap over a run of frames), with many mappings live;
//   2. the same for larger allocations (8, 32, 64 MiB): does a map cost per byte or per call?
//   3. whether cuMemUnmap / cuMemMap on the host wait for kernels already running elsewhere;
//   4. a kernel enqueued behind a long kernel reading a range mapped only after its launch;
//   5. a compute stream's slowdown while a helper thread remaps frames continuously;
//   6. memfd slabs: memfd + mmap + cuMemHostRegister of 1 GiB, and 2 MiB views of it elsewhere.
// Build: nvcc -O2 -arch=sm_90a -o vmm_remap vmm_remap.cu -lcuda
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#define CK(x)                                                                         \
  do {                                                                                \
    CUresult r_ = (x);                                                                \
    if (r_ != CUDA_SUCCESS) {                                                         \
      const char* s_;                                                                 \
      cuGetErrorString(r_, &s_);                                                      \
      std::fprintf(stderr, "%s:%d %s -> %s\n", __FILE__, __LINE__, #x, s_);           \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)
#define RK(x)                                                                                              \
  do {                                                                                                     \
    cudaError_t r_ = (x);                                                                                  \
    if (r_ != cudaSuccess) {                                                                               \
      std::fprintf(stderr, "%s:%d %s -> %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(r_));            \
      std::exit(1);                                                                                        \
    }                                                                                                      \
  } while (0)

static double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

__global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
__global__ void fill(unsigned* p, size_t n, unsigned v) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (i < n) p[i] = v + unsigned(i);
}
__global__ void check(const unsigned* p, size_t n, unsigned v, unsigned* bad) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (i < n && p[i] != v + unsigned(i)) atomicAdd(bad, 1u);
}
// An HBM-bound kernel: reads and writes a buffer.
__global__ void stream_copy(const float4* in, float4* out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) out[i] = in[i];
}

static CUmemAllocationProp device_prop() {
  CUmemAllocationProp p = {};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}
static CUmemAccessDesc rw() {
  CUmemAccessDesc a = {};
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = 0;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return a;
}

int main() {
  RK(cudaSetDevice(0));
  RK(cudaFree(0));
  const size_t frame = 2ull << 20;
  CUmemAllocationProp prop = device_prop();
  CUmemAccessDesc access = rw();

  // 1. Per frame and batched, with `live` other mappings present.
  const int frames = 1024;
  std::vector<CUmemGenericAllocationHandle> handles(frames);
  double t0 = now_us();
  for (auto& h : handles) CK(cuMemCreate(&h, frame, &prop, 0));
  double t1 = now_us();
  std::printf("create: %.1f us per 2 MiB frame\n", (t1 - t0) / frames);
  // Many live mappings elsewhere (a big resident space).
  const int live = 8192;
  std::vector<CUmemGenericAllocationHandle> live_handles(live);
  for (auto& h : live_handles) CK(cuMemCreate(&h, frame, &prop, 0));
  CUdeviceptr live_va;
  CK(cuMemAddressReserve(&live_va, live * frame, frame, 0, 0));
  for (int i = 0; i < live; ++i) CK(cuMemMap(live_va + i * frame, frame, 0, live_handles[i], 0));
  CK(cuMemSetAccess(live_va, live * frame, &access, 1));
  CUdeviceptr va;
  CK(cuMemAddressReserve(&va, 4ull * frames * frame, frame, 0, 0));
  for (int round = 0; round < 3; ++round) {
    double a = now_us();
    for (int i = 0; i < frames; ++i) CK(cuMemMap(va + i * frame, frame, 0, handles[i], 0));
    double b = now_us();
    for (int i = 0; i < frames; ++i) CK(cuMemSetAccess(va + i * frame, frame, &access, 1));
    double c = now_us();
    for (int i = 0; i < frames; ++i) CK(cuMemUnmap(va + i * frame, frame));
    double d = now_us();
    // Batched: map each, one set-access and one unmap per run of 32 frames.
    const int run = 32;
    for (int i = 0; i < frames; ++i) CK(cuMemMap(va + i * frame, frame, 0, handles[i], 0));
    double e = now_us();
    for (int i = 0; i < frames; i += run) CK(cuMemSetAccess(va + i * frame, run * frame, &access, 1));
    double f = now_us();
    CUresult batched_unmap = CUDA_SUCCESS;
    for (int i = 0; i < frames; i += run) {
      batched_unmap = cuMemUnmap(va + i * frame, run * frame);
      if (batched_unmap != CUDA_SUCCESS) break;
    }
    double g = now_us();
    if (batched_unmap != CUDA_SUCCESS) {
      const char* s;
      cuGetErrorString(batched_unmap, &s);
      std::printf("batched unmap over 32 mappings failed: %s; unmapping one by one\n", s);
      for (int i = 0; i < frames; ++i) cuMemUnmap(va + i * frame, frame);
    }
    std::printf("round %d (%d live mappings): map %.1f, set-access %.1f, unmap %.1f us per frame; "
                "batched (32): map %.1f, set-access %.1f, unmap %.1f us per frame\n",
                round, live, (b - a) / frames, (c - b) / frames, (d - c) / frames, (e - d) / frames,
                (f - e) / frames, (g - f) / frames);
  }

  // 2. Larger allocations.
  for (size_t mib : {8, 32, 64}) {
    size_t bytes = mib << 20;
    const int count = 16;
    std::vector<CUmemGenericAllocationHandle> big(count);
    double a = now_us();
    for (auto& h : big) CK(cuMemCreate(&h, bytes, &prop, 0));
    double b = now_us();
    CUdeviceptr bva;
    CK(cuMemAddressReserve(&bva, count * bytes, frame, 0, 0));
    double c = now_us();
    for (int i = 0; i < count; ++i) CK(cuMemMap(bva + i * bytes, bytes, 0, big[i], 0));
    double d = now_us();
    for (int i = 0; i < count; ++i) CK(cuMemSetAccess(bva + i * bytes, bytes, &access, 1));
    double e = now_us();
    for (int i = 0; i < count; ++i) CK(cuMemUnmap(bva + i * bytes, bytes));
    double f = now_us();
    std::printf("%zu MiB allocations: create %.1f, map %.1f, set-access %.1f, unmap %.1f us per allocation\n", mib,
                (b - a) / count, (d - c) / count, (e - d) / count, (f - e) / count);
    for (auto h : big) CK(cuMemRelease(h));
    CK(cuMemAddressFree(bva, count * bytes));
  }

  // 3. Do map / unmap on the host wait for a kernel running elsewhere?
  {
    cudaStream_t s;
    RK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    spin<<<1, 1, 0, s>>>(2000ll * 1000 * 1000);  // ~1 s at ~2 GHz
    usleep(20000);
    double a = now_us();
    for (int i = 0; i < 32; ++i) CK(cuMemMap(va + i * frame, frame, 0, handles[i], 0));
    CK(cuMemSetAccess(va, 32 * frame, &access, 1));
    double b = now_us();
    for (int i = 0; i < 32; ++i) CK(cuMemUnmap(va + i * frame, frame));
    double c = now_us();
    cudaError_t q = cudaStreamQuery(s);
    std::printf("while a 1 s kernel runs: 32 maps + set-access %.1f us, 32 unmaps %.1f us; kernel still running: %s\n",
                b - a, c - b, q == cudaErrorNotReady ? "yes (no implicit sync)" : "no (the calls waited)");
    RK(cudaStreamSynchronize(s));
    RK(cudaStreamDestroy(s));
  }

  // 4. A kernel enqueued before its range is mapped, behind a long kernel.
  {
    cudaStream_t s;
    RK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    // Fill frames 0..7 through a temporary mapping elsewhere first.
    CUdeviceptr tmp;
    CK(cuMemAddressReserve(&tmp, 8 * frame, frame, 0, 0));
    for (int i = 0; i < 8; ++i) CK(cuMemMap(tmp + i * frame, frame, 0, handles[100 + i], 0));
    CK(cuMemSetAccess(tmp, 8 * frame, &access, 1));
    size_t n = 8 * frame / 4;
    fill<<<(n + 255) / 256, 256, 0, s>>>(reinterpret_cast<unsigned*>(tmp), n, 1234u);
    RK(cudaStreamSynchronize(s));
    unsigned* bad;
    RK(cudaMalloc(&bad, 4));
    RK(cudaMemsetAsync(bad, 0, 4, s));
    spin<<<1, 1, 0, s>>>(400ll * 1000 * 1000);  // ~0.2 s
    CUdeviceptr target = va + 512 * frame;
    check<<<(n + 255) / 256, 256, 0, s>>>(reinterpret_cast<unsigned*>(target), n, 1234u, bad);
    usleep(20000);
    for (int i = 0; i < 8; ++i) CK(cuMemMap(target + i * frame, frame, 0, handles[100 + i], 0));
    CK(cuMemSetAccess(target, 8 * frame, &access, 1));
    cudaError_t e = cudaStreamSynchronize(s);
    unsigned host_bad = 0;
    if (e == cudaSuccess) RK(cudaMemcpy(&host_bad, bad, 4, cudaMemcpyDeviceToHost));
    std::printf("kernel launched before its range was mapped: %s, %u wrong words\n", cudaGetErrorString(e), host_bad);
    if (e != cudaSuccess) return 0;
    for (int i = 0; i < 8; ++i) CK(cuMemUnmap(target + i * frame, frame));
    for (int i = 0; i < 8; ++i) CK(cuMemUnmap(tmp + i * frame, frame));
    RK(cudaStreamDestroy(s));
  }

  // 5. HBM-bound kernel time, alone and while a helper thread remaps 64 frames in a loop.
  {
    size_t bytes = 4ull << 30;
    float4 *in, *out;
    RK(cudaMalloc(&in, bytes));
    RK(cudaMalloc(&out, bytes));
    cudaStream_t s;
    RK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    RK(cudaEventCreate(&e0));
    RK(cudaEventCreate(&e1));
    auto time_kernels = [&]() {
      RK(cudaEventRecord(e0, s));
      for (int i = 0; i < 50; ++i) stream_copy<<<132 * 8, 512, 0, s>>>(in, out, bytes / 16);
      RK(cudaEventRecord(e1, s));
      RK(cudaEventSynchronize(e1));
      float ms;
      RK(cudaEventElapsedTime(&ms, e0, e1));
      return ms;
    };
    time_kernels();
    float alone = time_kernels();
    std::atomic<bool> stop{false};
    std::atomic<long> remaps{0};
    std::thread helper([&] {
      CUcontext ctx;
      CK(cuDevicePrimaryCtxRetain(&ctx, 0));
      CK(cuCtxSetCurrent(ctx));
      while (!stop.load()) {
        for (int i = 0; i < 64; ++i) CK(cuMemMap(va + i * frame, frame, 0, handles[i], 0));
        CK(cuMemSetAccess(va, 64 * frame, &access, 1));
        if (cuMemUnmap(va, 64 * frame) != CUDA_SUCCESS) {
          // A batched unmap was refused: the frames are still mapped, unmap them one by one.
          for (int i = 0; i < 64; ++i) CK(cuMemUnmap(va + i * frame, frame));
        }
        remaps += 64;
      }
    });
    double a = now_us();
    float busy = time_kernels();
    double b = now_us();
    stop = true;
    helper.join();
    std::printf("HBM-bound kernels: %.2f ms alone, %.2f ms while a thread remapped %.0f frames/s (%.3fx)\n", alone,
                busy, remaps.load() / ((b - a) * 1e-6), busy / alone);
  }

  // 6. memfd slab.
  {
    size_t bytes = 1ull << 30;
    double a = now_us();
    int fd = memfd_create("membar-probe-slab", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, bytes) != 0) {
      std::perror("memfd");
      return 1;
    }
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    double b = now_us();
    CK(cuMemHostRegister(p, bytes, CU_MEMHOSTREGISTER_PORTABLE));
    double c = now_us();
    // A 2 MiB view at offset 512 MiB, as a client would map one frame of the slab.
    void* view = mmap(nullptr, frame, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 512ull << 20);
    std::memset(static_cast<char*>(p) + (512ull << 20), 0x5a, 64);
    bool same = static_cast<unsigned char*>(view)[63] == 0x5a;
    std::printf("memfd slab 1 GiB: create+populate %.1f ms, cuMemHostRegister %.1f ms, 2 MiB view sees writes: %s\n",
                (b - a) / 1000, (c - b) / 1000, same ? "yes" : "NO");
  }
  std::printf("probe done\n");
  return 0;
}
