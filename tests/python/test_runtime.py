"""The runtime from Python (bindings/csrc/runtime_ops.cpp + membar/runtime.py) on the embedded
host backend (and through a membard daemon when one is built): a space's pool with page p at row p
(any page size), contents surviving offload / prefetch / eviction at the same addresses, host
access, schedules, stats, and clear errors for bad input."""
import pytest
import torch

from membar.runtime import Runtime

MIB = 1 << 20


def embedded(gpu_frames=8, host_frames=32, **kwargs):
    return Runtime.connect(embedded=True, backend="host", gpu_pool_bytes=gpu_frames * 2 * MIB,
                           host_pool_bytes=host_frames * 2 * MIB, **kwargs)


def test_pool_roundtrip_through_host_memory():
    rt = embedded()
    assert rt.describe() == "embedded:host" and rt.backend == "host"
    keys = rt.space("L00.k", page_shape=(128, 4, 128), dtype=torch.bfloat16, pages=16)
    assert keys.page_bytes == 128 * 4 * 128 * 2
    pool = keys.pool()
    assert pool.shape == (16, 128, 4, 128) and pool.dtype == torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    data = torch.randn(16, 128, 4, 128, generator=generator).to(torch.bfloat16)
    acquired = keys.acquire(0, 16, write=True, zero=True, wait=True)
    assert (acquired.first, acquired.count) == (0, 16)
    assert torch.count_nonzero(pool) == 0  # zero-filled
    pool[:] = data
    address = pool.data_ptr()
    keys.release(0, 16, dirty=True)
    rt.wait(keys.offload())
    stats = rt.stats()["clients"][0]
    assert stats["bytes_host"] == 16 * keys.page_bytes and stats["bytes_gpu_to_host"] == 16 * keys.page_bytes
    keys.acquire(wait=True)
    assert pool.data_ptr() == address and torch.equal(pool, data)  # back at the same addresses
    keys.release()
    host = keys.acquire_host(3, 2)
    assert host.shape == (2, keys.page_bytes) and host.dtype == torch.uint8
    assert torch.equal(host[0].view(torch.bfloat16).view(128, 4, 128), data[3])
    keys.release_host(3, 2)


@pytest.mark.parametrize("page_shape", [(16, 3, 5), (64, 2, 96), (128, 4, 128), (7,)])
def test_pages_of_any_size_keep_their_contents(page_shape):
    """960-byte, 48 KiB, 256 KiB and 28-byte pages (float32): pages straddle 2 MiB frames."""
    rt = embedded(gpu_frames=3, host_frames=64)
    pages = max(4, (9 << 20) // (4 * torch.Size(page_shape).numel()))  # ~9 MiB: more than the GPU pool
    space = rt.space("odd", page_shape=page_shape, dtype=torch.float32, pages=pages)
    pool = space.pool()
    expected = torch.randn((pages,) + tuple(page_shape), generator=torch.Generator().manual_seed(len(page_shape)))
    step = max(1, pages // 5)
    for first in range(0, pages, step):
        count = min(step, pages - first)
        space.acquire(first, count, write=True, wait=True)
        pool[first:first + count] = expected[first:first + count]
        space.release(first, count, dirty=True)
    for first in reversed(range(0, pages, step)):
        count = min(step, pages - first)
        space.acquire(first, count, wait=True)
        assert torch.equal(pool[first:first + count], expected[first:first + count])
        space.release(first, count)
    host = space.acquire_host(0, pages)
    assert torch.equal(host.view(torch.float32).view_as(expected), expected)
    space.release_host(0, pages)


def test_eviction_under_a_small_gpu_pool_keeps_every_page():
    rt = embedded(gpu_frames=2, host_frames=32)
    space = rt.space("grads", page_bytes=1 * MIB, pages=12)
    pool = space.pool(torch.float32)
    generator = torch.Generator().manual_seed(1)
    expected = torch.randn(12, MIB // 4, generator=generator)
    for page in range(12):  # 12 MiB through a 4 MiB pool: evictions write dirty frames back
        space.acquire(page, 1, write=True, wait=True)
        pool[page] = expected[page]
        space.release(page, 1, dirty=True)
    assert rt.stats()["clients"][0]["evictions"] >= 4
    for page in reversed(range(12)):
        space.acquire(page, 1, wait=True)
        assert torch.equal(pool[page], expected[page])
        space.release(page, 1)


def test_schedule_prefetches_ahead():
    rt = embedded(gpu_frames=2, host_frames=16)
    space = rt.space("kv", page_bytes=2 * MIB, pages=4)
    pool = space.pool(torch.int32)
    for page in range(4):
        host = space.acquire_host(page, 1)
        host[0].view(torch.int32).fill_(page + 10)
        space.release_host(page, 1, dirty=True)
    rt.set_schedule([[space.range(page, 1)] for page in range(4)])
    for step in range(4):
        rt.advance(step)
        space.acquire(step, 1, wait=True)
        assert int(pool[step, 0]) == step + 10
        space.release(step, 1)
    stats = rt.stats()["clients"][0]
    assert stats["prefetch_misses"] == 0 and stats["prefetch_hits"] == 4


def test_acquire_ranges_with_the_schedule_step_is_one_call():
    rt = embedded(gpu_frames=4, host_frames=16)
    keys = rt.space("k", page_bytes=1 * MIB, pages=4)
    values = rt.space("v", page_bytes=1 * MIB, pages=4)
    rt.set_schedule([[keys.range(0, 4), values.range(0, 4)]])
    ticket = rt._native.acquire_ranges([keys.id, 0, 4, values.id, 0, 4], True, True, 0)
    rt.wait(ticket)
    keys.pool(torch.uint8)[:] = 1
    values.pool(torch.uint8)[:] = 2
    rt._native.release_ranges([keys.id, 0, 4, values.id, 0, 4], True)
    assert rt.stats()["clients"][0]["bytes_gpu"] == 8 * MIB


def test_bad_input_raises_clear_errors():
    rt = embedded()
    space = rt.space("s", page_bytes=64 << 10, pages=4)
    with pytest.raises(RuntimeError, match="OUT_OF_RANGE"):
        space.acquire(3, 2)
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT"):
        space.acquire(0, 0)
    with pytest.raises(RuntimeError, match="FAILED_PRECONDITION"):
        space.release(0, 1)
    space.acquire(0, 1, write=True, wait=True)
    space.release(0, 1, dirty=True)
    space.free(0, 1)
    with pytest.raises(RuntimeError, match="double free"):
        space.free(0, 1)
    with pytest.raises(RuntimeError, match="ALREADY_EXISTS"):
        rt.space("s", page_bytes=64 << 10, pages=4)
    with pytest.raises(RuntimeError, match="page size"):
        rt.space("huge", page_bytes=2 << 30, pages=1)
    with pytest.raises(RuntimeError, match="holds"):
        space.pool(torch.float16, (100,))
    with pytest.raises(RuntimeError, match="OUT_OF_RANGE"):
        rt.advance(0)
    with pytest.raises(RuntimeError, match="UNIMPLEMENTED"):
        rt._native.stream_wait(1, 0)
    with pytest.raises(RuntimeError, match="never issued"):
        rt.wait(10_000)
    with pytest.raises(RuntimeError, match="backend must be"):
        Runtime.connect(embedded=True, backend="tpu")
    with pytest.raises(ValueError):
        Runtime.connect(socket="/tmp/x.sock", embedded=True)


def test_pool_keeps_the_runtime_alive():
    rt = embedded()
    space = rt.space("s", page_bytes=64 << 10, pages=2)
    pool = space.pool(torch.uint8)
    space.acquire(0, 2, write=True, zero=True, wait=True)
    del rt, space  # the pool's deleter holds the native runtime: the space stays mapped
    import gc
    gc.collect()
    pool[:] = 7
    assert int(pool.sum()) == 7 * 2 * (64 << 10)


def test_daemon_only_without_a_daemon_is_an_error(tmp_path):
    with pytest.raises(RuntimeError, match="UNAVAILABLE|NOT_FOUND|no"):
        Runtime.connect(socket=str(tmp_path / "absent.sock"), embedded=False)


def test_same_api_through_a_daemon(membard):
    socket = membard()
    rt = Runtime.connect(socket=str(socket), embedded=False, name="pytest")
    assert rt.describe().startswith("daemon:")
    space = rt.space("L00.v", page_shape=(64, 4, 128), dtype=torch.float32, pages=40)  # 128 KiB pages
    pool = space.pool()
    generator = torch.Generator().manual_seed(3)
    data = torch.randn(40, 64, 4, 128, generator=generator)
    for first in range(0, 40, 8):
        space.acquire(first, 8, write=True, wait=True)
        pool[first:first + 8] = data[first:first + 8]
        space.release(first, 8, dirty=True)
        rt.wait(space.offload(first, 8))
    for first in range(0, 40, 8):
        space.acquire(first, 8, wait=True)
        assert torch.equal(pool[first:first + 8], data[first:first + 8])
        space.release(first, 8)
    stats = rt.stats()
    assert stats["backend"] == "host"
    assert stats["clients"][0]["name"] == "pytest"
    # The GPU tier has no NUMA node; the host tier's is a node or -1 (placed by the kernel).
    assert [tier["tier"] for tier in stats["tiers"]] == ["gpu", "host"]
    assert stats["tiers"][0]["numa_node"] == -1 and stats["tiers"][1]["numa_node"] >= -1
    # Pages move in the 2 MiB frames of the space: offloading pages [0, 8) and then [8, 16)
    # copies frame 0 twice (dirty again in between), 2+2+2+2+1 MiB in all (the last frame is half).
    assert stats["clients"][0]["bytes_gpu_to_host"] == 9 * MIB
    # Per-space residency: every page was offloaded, then acquired back (clean on both tiers).
    (entry,) = [s for s in stats["spaces"] if s["name"] == "L00.v"]
    assert entry["client"] == stats["clients"][0]["client"]
    assert entry["bytes_both"] + entry["bytes_host"] == 40 * space.page_bytes and entry["bytes_dirty"] == 0
    assert entry["bytes_gpu_to_host"] == 9 * MIB


def test_a_daemon_of_two_devices_keeps_each_devices_pages(membard):
    import json
    import subprocess

    from conftest import membard_binary

    socket = membard("--devices", "0,1")
    first = Runtime.connect(socket=str(socket), embedded=False, name="unnamed")
    second = Runtime.connect(socket=str(socket), embedded=False, name="on-one", device=1)
    assert (first.device_index, second.device_index) == (0, 1)
    generator = torch.Generator().manual_seed(5)
    written = {}
    for rt in (first, second):
        space = rt.space("L00.k", page_bytes=256 * 1024, pages=8)  # the same name on each device
        data = torch.randint(0, 255, (8, 256 * 1024), dtype=torch.uint8, generator=generator)
        space.acquire(0, 8, write=True, wait=True)
        space.pool()[:] = data  # [pages, page_bytes] of uint8
        space.release(0, 8, dirty=True)
        rt.wait(space.offload(0, 8))
        written[rt.device_index] = (space, data)
    for device, (space, data) in written.items():
        space.acquire(0, 8, wait=True)
        assert torch.equal(space.pool(), data), device
        space.release(0, 8)
    with pytest.raises(RuntimeError, match="this membard serves devices 0, 1; not 2"):
        Runtime.connect(socket=str(socket), embedded=False, device=2)
    ctl = membard_binary().parent / "membarctl"
    stats = json.loads(subprocess.run([str(ctl), "--socket", str(socket), "stats", "--json"], check=True,
                                      capture_output=True, text=True).stdout)
    assert [d["device"] for d in stats["devices"]] == [0, 1]
    assert {c["name"]: c["device"] for c in stats["clients"]} == {"unnamed": 0, "on-one": 1}


def test_each_device_of_a_daemon_sees_the_whole_node_host_pool(membard):
    """Note [One host pool for a node]: pool_bytes_left (what the hybrid planner plans against) counts
    the host frames a device would get from the node's pool, not only the half it backs, and what
    another device holds comes off it."""
    socket = membard("--devices", "0,1", host_pool="128MiB")
    zero = Runtime.connect(socket=str(socket), embedded=False, name="zero", device=0)
    one = Runtime.connect(socket=str(socket), embedded=False, name="one", device=1)
    assert zero.pool_bytes_left()[1] == one.pool_bytes_left()[1] == 128 * MIB
    host = [tier for tier in zero.stats()["tiers"] if tier["tier"] == "host"][0]
    assert host["frames_on_request"] == 32 and host["frames_total"] == 32   # its half backed, the rest elsewhere
    space = one.space("held", page_bytes=MIB, pages=40)
    space.acquire_host(0, 40)   # 40 MiB on device 1's host tier
    assert zero.pool_bytes_left()[1] <= 128 * MIB - 40 * MIB
    assert zero.pool_bytes_left()[1] + one.stats()["tiers"][1]["frames_used"] * 2 * MIB == 128 * MIB
    space.release_host(0, 40, dirty=True)


def test_waits_measured_by_the_caller_reach_membarctl(membard):
    """A CUDA stream's wait for pages happens on the GPU, where the runtime cannot see it: a trainer
    that times it reports it (Runtime.add_stall_ns), and operators see it in the client's stall
    time beside the host's own waits, through membard and embedded alike."""
    import json
    import subprocess

    from conftest import membard_binary

    socket = membard()
    rt = Runtime.connect(socket=str(socket), embedded=False, name="timed-trainer")
    before = rt.stats()["clients"][0]["stall_ns"]
    rt.add_stall_ns(250_000_000)
    rt.add_stall_ns(5_000)
    assert rt.stats()["clients"][0]["stall_ns"] == before + 250_005_000   # travels with the next request
    ctl = membard_binary().parent / "membarctl"
    stats = json.loads(subprocess.run([str(ctl), "--socket", str(socket), "stats", "--json"], check=True,
                                      capture_output=True, text=True).stdout)
    (client,) = [c for c in stats["clients"] if c["name"] == "timed-trainer"]
    assert client["stall_ns"] >= 250_005_000
    with pytest.raises(RuntimeError, match="must not be negative"):
        rt.add_stall_ns(-1)
    embedded = Runtime.connect(embedded=True, backend="host", gpu_pool_bytes=4 * MIB, host_pool_bytes=8 * MIB)
    embedded.add_stall_ns(7_000)
    assert embedded.stats()["clients"][0]["stall_ns"] == 7_000


def test_channels_in_one_process_embedded():
    import numpy as np
    writer = embedded()
    reader = embedded()
    channel = writer.create_channel("pytest.embedded", 1 << 16)
    assert channel.writable and channel.nbytes == 1 << 16
    words = np.frombuffer(channel.buffer, dtype=np.uint64)
    assert not words.any(), "channels start zero-filled"
    expected = np.random.default_rng(5).integers(0, 2**63, size=words.size, dtype=np.uint64)
    words[:] = expected
    opened = reader.open_channel("pytest.embedded")
    seen = np.frombuffer(opened.buffer, dtype=np.uint64)
    assert not opened.writable and np.array_equal(seen, expected)
    with pytest.raises(TypeError):
        opened.buffer[0] = 1  # read-only for openers
    with pytest.raises(RuntimeError, match="ALREADY_EXISTS"):
        writer.create_channel("pytest.embedded", 4096)
    with pytest.raises(RuntimeError, match="NOT_FOUND"):
        reader.open_channel("pytest.nobody")
    del words, seen
    opened.close()
    channel.close()
    with pytest.raises(RuntimeError, match="NOT_FOUND"):
        reader.open_channel("pytest.embedded")


_CHANNEL_READER = """
import sys, numpy as np
from membar.runtime import Runtime
rt = Runtime.connect(socket=sys.argv[1], embedded=False, name="reader")
channel = rt.open_channel("pytest.daemon")
words = np.frombuffer(channel.buffer, dtype=np.uint64)
expected = np.arange(words.size, dtype=np.uint64) * np.uint64(2654435761)
print("match" if np.array_equal(words, expected) else "differ", channel.writable)
"""


def test_channels_reach_another_process_through_a_daemon(membard):
    import subprocess
    import sys
    import numpy as np

    socket = membard()
    rt = Runtime.connect(socket=str(socket), embedded=False, name="writer")
    channel = rt.create_channel("pytest.daemon", 1 << 20)
    words = np.frombuffer(channel.buffer, dtype=np.uint64)
    words[:] = np.arange(words.size, dtype=np.uint64) * np.uint64(2654435761)
    answer = subprocess.run([sys.executable, "-c", _CHANNEL_READER, str(socket)], capture_output=True, text=True,
                            timeout=60)
    assert answer.stdout.split() == ["match", "False"], answer.stderr
    del words
    channel.close()
