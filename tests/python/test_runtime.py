"""The runtime from Python (bindings/csrc/runtime_ops.cpp + membar/runtime.py) on the embedded
host backend (and through a membard daemon when one is built): pools over the window, contents
surviving offload / prefetch / eviction, host access, schedules, stats, and clear errors for bad
input."""
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
    assert pool.shape == (rt.window_bytes // keys.page_bytes, 128, 4, 128) and pool.dtype == torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    data = torch.randn(16, 128, 4, 128, generator=generator).to(torch.bfloat16)
    acquired = keys.acquire(0, 16, write=True, zero=True, wait=True)
    assert acquired.indices.dtype == torch.int32 and acquired.indices.unique().numel() == 16
    assert torch.count_nonzero(pool[acquired.indices.long()]) == 0  # zero-filled
    pool[acquired.indices.long()] = data
    keys.release(0, 16, dirty=True)
    rt.wait(keys.offload())
    assert (keys.indices() == -1).all()
    stats = rt.stats()["clients"][0]
    assert stats["pages_host"] == 16 and stats["bytes_gpu_to_host"] == 16 * keys.page_bytes
    back = keys.acquire(wait=True)
    assert torch.equal(pool[back.indices.long()], data)
    keys.release()
    host = keys.acquire_host(3, 2)
    assert len(host) == 2 and host[0].dtype == torch.uint8 and host[0].numel() == keys.page_bytes
    assert torch.equal(host[0].view(torch.bfloat16).view(128, 4, 128), data[3])
    keys.release_host(3, 2)


def test_eviction_under_a_small_window_keeps_every_page():
    rt = embedded(gpu_frames=2, host_frames=32)
    space = rt.space("grads", page_bytes=1 * MIB, pages=12)
    pool = space.pool(torch.float32)
    generator = torch.Generator().manual_seed(1)
    expected = torch.randn(12, MIB // 4, generator=generator)
    for page in range(12):  # 12 MiB through a 4 MiB window: evictions write dirty pages back
        acquired = space.acquire(page, 1, write=True, wait=True)
        pool[acquired.indices.long()] = expected[page]
        space.release(page, 1, dirty=True)
    assert rt.stats()["clients"][0]["evictions"] >= 8
    for page in reversed(range(12)):
        acquired = space.acquire(page, 1, wait=True)
        assert torch.equal(pool[acquired.indices.long()][0], expected[page])
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
        acquired = space.acquire(step, 1, wait=True)
        assert int(pool[acquired.indices.long()][0, 0]) == step + 10
        space.release(step, 1)
    stats = rt.stats()["clients"][0]
    assert stats["prefetch_misses"] == 0 and stats["prefetch_hits"] == 4


def test_bad_input_raises_clear_errors():
    rt = embedded()
    space = rt.space("s", page_bytes=64 << 10, pages=4)
    with pytest.raises(RuntimeError, match="OUT_OF_RANGE"):
        space.acquire(3, 2)
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT"):
        space.acquire(0, 0)
    with pytest.raises(RuntimeError, match="FAILED_PRECONDITION"):
        space.release(0, 1)
    with pytest.raises(RuntimeError, match="double free"):
        space.free(0, 1)
    with pytest.raises(RuntimeError, match="ALREADY_EXISTS"):
        rt.space("s", page_bytes=64 << 10, pages=4)
    with pytest.raises(RuntimeError, match="power of two"):
        rt.space("odd", page_bytes=100_000, pages=4)
    with pytest.raises(RuntimeError, match="holds"):
        rt.pool(torch.float16, (100,), page_bytes=64 << 10)
    with pytest.raises(RuntimeError, match="OUT_OF_RANGE"):
        rt.advance(0)
    with pytest.raises(RuntimeError, match="UNIMPLEMENTED"):
        rt._native.stream_wait(1, 0)
    with pytest.raises(RuntimeError, match="backend must be"):
        Runtime.connect(embedded=True, backend="tpu")
    with pytest.raises(ValueError):
        Runtime.connect(socket="/tmp/x.sock", embedded=True)


def test_pool_keeps_the_runtime_alive():
    rt = embedded()
    space = rt.space("s", page_bytes=64 << 10, pages=2)
    pool = space.pool(torch.uint8)
    acquired = space.acquire(0, 2, write=True, zero=True, wait=True)
    rows = acquired.indices.long()
    del rt, space  # the pool's deleter holds the native runtime: the window stays mapped
    import gc
    gc.collect()
    pool[rows] = 7
    assert int(pool[rows].sum()) == 7 * 2 * (64 << 10)


def test_daemon_only_without_a_daemon_is_an_error(tmp_path):
    with pytest.raises(RuntimeError, match="UNAVAILABLE|NOT_FOUND|no"):
        Runtime.connect(socket=str(tmp_path / "absent.sock"), embedded=False)


def _membard():
    import os
    from pathlib import Path
    build = Path(os.environ.get("MEMBAR_BUILD_DIR", Path(__file__).resolve().parents[2] / "build"))
    binary = build / "bin" / "membard"
    return binary if binary.exists() else None


@pytest.mark.skipif(_membard() is None, reason="membard is not built (set MEMBAR_BUILD_DIR)")
def test_same_api_through_a_daemon(tmp_path):
    import subprocess
    import time

    socket = tmp_path / "membard.sock"
    daemon = subprocess.Popen([str(_membard()), "--backend", "host", "--socket", str(socket), "--gpu-pool", "16MiB",
                               "--host-pool", "64MiB", "--foreground", "--log-level", "warn"])
    try:
        for _ in range(200):
            if socket.exists():
                break
            time.sleep(0.02)
        rt = Runtime.connect(socket=str(socket), embedded=False, name="pytest")
        assert rt.describe().startswith("daemon:")
        space = rt.space("L00.v", page_shape=(64, 4, 128), dtype=torch.float32, pages=40)  # 128 KiB pages
        pool = space.pool()
        generator = torch.Generator().manual_seed(3)
        data = torch.randn(40, 64, 4, 128, generator=generator)
        for first in range(0, 40, 8):
            acquired = space.acquire(first, 8, write=True, wait=True)
            pool[acquired.indices.long()] = data[first:first + 8]
            space.release(first, 8, dirty=True)
            rt.wait(space.offload(first, 8))
        for first in range(0, 40, 8):
            acquired = space.acquire(first, 8, wait=True)
            assert torch.equal(pool[acquired.indices.long()], data[first:first + 8])
            space.release(first, 8)
        stats = rt.stats()
        assert stats["backend"] == "host"
        assert stats["clients"][0]["bytes_gpu_to_host"] == 40 * space.page_bytes
        # Per-space residency: every page was offloaded, then acquired back (clean on both tiers).
        (entry,) = [s for s in stats["spaces"] if s["name"] == "L00.v"]
        assert entry["client"] == stats["clients"][0]["client"]
        assert entry["pages_both"] + entry["pages_host"] == 40 and entry["pages_dirty"] == 0
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)


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


@pytest.mark.skipif(_membard() is None, reason="membard is not built (set MEMBAR_BUILD_DIR)")
def test_channels_reach_another_process_through_a_daemon(tmp_path):
    import subprocess
    import sys
    import time
    import numpy as np

    socket = tmp_path / "membard.sock"
    daemon = subprocess.Popen([str(_membard()), "--backend", "host", "--socket", str(socket), "--gpu-pool", "16MiB",
                               "--host-pool", "64MiB", "--foreground", "--log-level", "warn"])
    try:
        for _ in range(200):
            if socket.exists():
                break
            time.sleep(0.02)
        rt = Runtime.connect(socket=str(socket), embedded=False, name="writer")
        channel = rt.create_channel("pytest.daemon", 1 << 20)
        words = np.frombuffer(channel.buffer, dtype=np.uint64)
        words[:] = np.arange(words.size, dtype=np.uint64) * np.uint64(2654435761)
        answer = subprocess.run([sys.executable, "-c", _CHANNEL_READER, str(socket)], capture_output=True, text=True,
                                timeout=60)
        assert answer.stdout.split() == ["match", "False"], answer.stderr
        del words
        channel.close()
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)
