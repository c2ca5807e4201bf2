"""The runtime's Python API on the CUDA backend (embedded): pool tensors are CUDA tensors over
the space's VMM addresses (page p is row p), kernels write pages through them, and contents survive offload to
pinned host memory and eviction; a trainer stream can wait for a ticket on the GPU."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from membar.runtime import Runtime  # noqa: E402

MIB = 1 << 20


def test_cuda_pool_roundtrip_and_eviction():
    rt = Runtime.connect(embedded=True, backend="cuda", gpu_pool_bytes=8 * MIB, host_pool_bytes=64 * MIB)
    assert rt.describe() == "embedded:cuda" and rt.backend == "cuda"
    space = rt.space("L00.k", page_shape=(128, 4, 128), dtype=torch.bfloat16, pages=96)  # 12 MiB > 8 MiB
    pool = space.pool()
    assert pool.is_cuda and pool.shape[1:] == (128, 4, 128)
    generator = torch.Generator(device="cuda").manual_seed(0)
    expected = torch.randn(96, 128, 4, 128, generator=generator, device="cuda").to(torch.bfloat16)
    for first in range(0, 96, 16):
        space.acquire(first, 16, write=True, wait=True)
        pool[first:first + 16] = expected[first:first + 16]
        torch.cuda.synchronize()
        space.release(first, 16, dirty=True)
    assert rt.stats()["clients"][0]["evictions"] > 0
    for first in reversed(range(0, 96, 16)):
        acquired = space.acquire(first, 16)
        rt.stream_wait(acquired.ticket)  # the current stream waits on the GPU, no CPU round trip
        got = pool[first:first + 16].clone()
        assert torch.equal(got, expected[first:first + 16])
        space.stream_release(first, 16)  # released once the current stream has read the pages
    torch.cuda.synchronize()
    client = rt.stats()["clients"][0]
    assert client["bytes_gpu"] + client["bytes_both"] > 0 and client["bytes_gpu_to_host"] > 0
