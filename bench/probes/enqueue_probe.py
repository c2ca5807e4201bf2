# What handing copies to a CUDA stream costs the host (issue "One memory system": at 128K the
# offloaded 7B step spends 10.9 s of the trainer's host time handing ~2 MiB frame copies to the
# backend, session 16). Is that the call's own cost, or does cudaMemcpyAsync block once the copy
# stream holds too much queued work, so that the host waits for PCIe?
#
# For bursts of host-to-GPU copies from pinned memory (2, 8 and 64 MiB each, 4 GiB per burst, on an
# idle stream), times every cudaMemcpyAsync call on the host (called through ctypes on the
# libcudart torch loaded) and the burst on the GPU (CUDA events): per-call median, 99th percentile
# and maximum, the first call that took over 200 us and how many copies were queued then, the host
# time of the whole burst against the GPU's, and GB/s. The same 2 MiB burst through torch's
# Tensor.copy_(non_blocking=True) for comparison (what plain tensor pools pay per copy).
# Usage: enqueue_probe.py [OUT.json]
import ctypes
import json
import statistics
import sys
import time

import torch

MIB = 1 << 20
BURST_BYTES = 4096 * MIB
SLOW_NS = 200_000


def cudart():
    """The libcudart torch loaded (its path from /proc/self/maps), with cudaMemcpyAsync typed."""
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
    if not paths:
        raise RuntimeError("no libcudart in this process (torch linked CUDA statically?)")
    library = ctypes.CDLL(sorted(paths)[0])
    library.cudaMemcpyAsync.restype = ctypes.c_int
    library.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
    return library


def burst(copy_one, count, stream):
    """Host ns of each of `count` calls, and the burst's GPU ms (events around it)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    calls = []
    for index in range(count):
        began = time.perf_counter_ns()
        copy_one(index)
        calls.append(time.perf_counter_ns() - began)
    end.record(stream)
    torch.cuda.synchronize()
    return calls, start.elapsed_time(end)


def summary(name, size, calls, gpu_ms):
    slow = next((i for i, ns in enumerate(calls) if ns > SLOW_NS), None)
    host_ms = sum(calls) / 1e6
    row = dict(path=name, copy_mib=size // MIB, copies=len(calls), call_median_us=statistics.median(calls) / 1e3,
               call_p99_us=sorted(calls)[int(0.99 * (len(calls) - 1))] / 1e3, call_max_us=max(calls) / 1e3,
               first_slow_call=slow, queued_mib_at_first_slow=None if slow is None else slow * size // MIB,
               host_ms=host_ms, gpu_ms=gpu_ms, gb_per_s=len(calls) * size / gpu_ms / 1e6)
    print(f"{name:>18} {size // MIB:>3} MiB x {len(calls):>4}: call median {row['call_median_us']:7.1f} us, "
          f"p99 {row['call_p99_us']:8.1f} us, max {row['call_max_us']:9.1f} us; first call over "
          f"{SLOW_NS // 1000} us: {slow} ({row['queued_mib_at_first_slow']} MiB queued); host {host_ms:8.1f} ms, "
          f"GPU {gpu_ms:8.1f} ms, {row['gb_per_s']:5.1f} GB/s", flush=True)
    return row


def main():
    library = cudart()
    host = torch.empty(BURST_BYTES, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    device = torch.empty(BURST_BYTES, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    handle = ctypes.c_void_p(stream.cuda_stream)
    host_pointer, device_pointer = host.data_ptr(), device.data_ptr()
    rows = []
    for size in (2 * MIB, 8 * MIB, 64 * MIB):
        count = BURST_BYTES // size

        def memcpy(index, size=size):
            error = library.cudaMemcpyAsync(ctypes.c_void_p(device_pointer + index * size),
                                            ctypes.c_void_p(host_pointer + index * size), size, 1, handle)
            if error != 0:
                raise RuntimeError(f"cudaMemcpyAsync returned {error}")

        burst(memcpy, min(count, 64), stream)   # warm-up
        rows.append(summary("cudaMemcpyAsync", size, *burst(memcpy, count, stream)))
    size = 2 * MIB
    host_chunks, device_chunks = host.view(-1, size), device.view(-1, size)

    def tensor_copy(index):
        with torch.cuda.stream(stream):
            device_chunks[index].copy_(host_chunks[index], non_blocking=True)

    burst(tensor_copy, 64, stream)
    rows.append(summary("Tensor.copy_", size, *burst(tensor_copy, BURST_BYTES // size, stream)))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as out:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
