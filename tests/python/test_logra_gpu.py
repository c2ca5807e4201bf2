"""LoGRA on the GPU: same A for the same key, CUDA kernels against the CPU kernels, and the
layer / optimizer / sync path on CUDA tensors. Run by `make gpu-check` (marker gpu)."""
import pytest
import torch

from membar import logra
from membar.logra import ops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_same_key_same_projection_on_cpu_and_gpu():
    key = ops.ProjectionKey(2**40 + 3, 12, 345)
    assert torch.equal(logra.generate(key, 256, 3584).cpu(), logra.generate(key, 256, 3584, device="cuda").cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_project_bit_identical_to_cpu(dtype):
    torch.manual_seed(0)
    key = ops.ProjectionKey(9, 3, 1)
    x = torch.randn(777, 1000).to(dtype)
    cpu = logra.project(x, key, 192)
    gpu = logra.project(x.cuda(), key, 192, exact=True)
    assert torch.equal(cpu, gpu.cpu())


# 40000 x 256 is past the single sign tile (8M elements): the multi-tile fp32 path.
@pytest.mark.parametrize("in_features,rank", [(1000, 64), (4096, 64), (9000, 64), (18944, 256), (40000, 256)])
def test_tensor_core_projection_matches_cpu_within_rounding(in_features, rank):
    torch.manual_seed(4)
    key = ops.ProjectionKey(9, 3, 1)
    x = torch.randn(2, 300, in_features).to(torch.bfloat16)
    reference = x.double() @ logra.generate(key, rank, in_features).double().t()
    gpu = logra.project(x.cuda(), key, rank).cpu()
    assert gpu.shape == (2, 300, rank) and gpu.dtype == torch.bfloat16
    # One bf16 rounding of the output plus fp32 accumulation.
    assert ((gpu.double() - reference).abs() <= reference.abs() / 128 + 1e-3).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_update_bit_identical_to_cpu(dtype):
    torch.manual_seed(1)
    key = ops.ProjectionKey(5, 8, 2)
    weight = torch.randn(300, 520).to(dtype)
    update = torch.randn(300, 64)
    weight_gpu = weight.cuda()
    logra.fused_update_(weight, update, 0.01, key)
    logra.fused_update_(weight_gpu, update.cuda(), 0.01, key, exact=True)
    assert torch.equal(weight, weight_gpu.cpu())


def test_stochastic_rounding_bit_identical_to_cpu():
    torch.manual_seed(5)
    key = ops.ProjectionKey(5, 8, 2)
    weight = torch.randn(200, 700).to(torch.bfloat16)
    update = torch.randn(200, 32) * 1e-3
    weight_gpu = weight.cuda()
    seed = ops.rounding_seed_for(3, 17)
    logra.fused_update_(weight, update, 0.1, key, seed)
    logra.fused_update_(weight_gpu, update.cuda(), 0.1, key, seed, exact=True)
    assert torch.equal(weight, weight_gpu.cpu())


# Shapes with ragged edges in every tile dimension (rows % 64, columns % 128, rank % 64), the 7B
# shapes' rank / width, and the kernel's scalar paths (rank % 4 != 0: U read one float at a time;
# columns % 4 != 0: W read one element at a time).
@pytest.mark.parametrize("rows,columns,rank", [(300, 520, 64), (131, 1000, 16), (64, 128, 256), (200, 3584, 100),
                                               (96, 18944, 64), (131, 1001, 7)])
def test_tensor_core_update_matches_fp64_reference(rows, columns, rank):
    torch.manual_seed(6)
    key = ops.ProjectionKey(5, 8, 2)
    weight = torch.randn(rows, columns)
    update = torch.randn(rows, rank)
    coefficient = 0.37
    reference = weight.double() - coefficient * update.double() @ logra.generate(key, rank, columns).double()
    weight_gpu = weight.cuda()
    logra.fused_update_(weight_gpu, update.cuda(), coefficient, key)
    # U is carried as two bf16 terms (error at most 2^-16 |U|) and summed in fp32 over 2r terms;
    # 2^-14 of sum |U| covers both with room (a bf16-only U would be off by up to 2^-8).
    bound = coefficient / rank ** 0.5 * update.abs().double().sum(1, keepdim=True) * 2.0 ** -14
    error = (weight_gpu.cpu().double() - reference).abs()
    assert (error <= bound + reference.abs() * 2.0 ** -23).all(), float((error - bound).max())
    # The fast kernel is deterministic.
    again = weight.cuda()
    logra.fused_update_(again, update.cuda(), coefficient, key)
    assert torch.equal(again, weight_gpu)


# 700 columns: W read element by element (700 % 8 != 0); 704: in 16-byte vectors.
@pytest.mark.parametrize("columns", [700, 704])
def test_tensor_core_update_of_bf16_weights_rounds_like_the_exact_kernel(columns):
    torch.manual_seed(7)
    key = ops.ProjectionKey(11, 2, 9)
    weight = torch.randn(257, columns).to(torch.bfloat16).cuda()
    update = torch.randn(257, 64).cuda() * 1e-3
    seed = ops.rounding_seed_for(3, 5)
    results = {}
    for exact in (True, False):
        for rounding in (0, seed):
            target = weight.clone()
            logra.fused_update_(target, update, 0.5, key, rounding, exact=exact)
            results[exact, rounding] = target.float()
    for rounding in (0, seed):
        # Both kernels round the same fp32 value up to summation order: at most one bf16 ulp apart,
        # and nearly always identical.
        difference = (results[True, rounding] - results[False, rounding]).abs()
        ulp = results[True, rounding].abs() * 2.0 ** -7 + 1e-30
        assert (difference <= ulp).all()
        assert (difference == 0).float().mean() > 0.99
    # Stochastic rounding moves weights that nearest rounding leaves alone.
    assert not torch.equal(results[False, 0], results[False, seed])


def test_sketch_accumulate_bf16_on_gpu_matches_reference():
    torch.manual_seed(2)
    sketch = torch.randn(1536, 64, device="cuda")
    initial = sketch.clone()
    grad_output = torch.randn(4, 2048, 1536, device="cuda", dtype=torch.bfloat16)
    projected = torch.randn(4, 2048, 64, device="cuda", dtype=torch.bfloat16)
    logra.sketch_accumulate_(sketch, grad_output, projected)
    reference = initial + grad_output.float().reshape(-1, 1536).t() @ projected.float().reshape(-1, 64)
    torch.testing.assert_close(sketch, reference, rtol=1e-3, atol=1e-2)


def test_chunked_linear_cross_entropy_on_gpu_matches_full_logits():
    from membar.logra.loss import chunked_linear_cross_entropy

    torch.manual_seed(8)
    hidden = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(5000, 256, device="cuda") * 0.05).to(torch.bfloat16)
    labels = torch.randint(0, 5000, (2, 300), device="cuda")
    labels[1, :7] = -100
    loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk_tokens=128)
    loss.backward()
    reference_hidden = hidden.detach().clone().requires_grad_(True)
    reference = torch.nn.functional.cross_entropy((reference_hidden @ weight.t()).float().reshape(-1, 5000),
                                                  labels.reshape(-1))
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden.grad.float(), reference_hidden.grad.float(), rtol=2e-2, atol=1e-5)


def test_layer_and_optimizer_on_gpu_match_cpu():
    torch.manual_seed(3)
    results = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(96, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64)).to(device)
        handle = logra.apply_logra(model, rank=16, targets=("0", "2"), seed=4)
        optimizer = logra.LoGRAOptimizer(handle, lr=1e-2)
        x = torch.randn(32, 96, generator=torch.Generator().manual_seed(0)).to(device)
        for _ in range(3):
            model(x).square().mean().backward()
            optimizer.step()
        results.append([layer.weight.detach().cpu() for layer in handle.layers])
    for cpu_weight, gpu_weight in zip(*results):
        torch.testing.assert_close(cpu_weight, gpu_weight, rtol=1e-4, atol=1e-5)


def test_states_as_cuda_runtime_pages_with_offloaded_moments_match_plain_tensors():
    from membar.runtime import Runtime

    results = []
    for use_runtime in (False, True):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(96, 640), torch.nn.Tanh(), torch.nn.Linear(640, 64)).cuda()
        runtime = (Runtime.connect(embedded=True, backend="cuda", gpu_pool_bytes=16 << 20, host_pool_bytes=16 << 20)
                   if use_runtime else None)
        handle = logra.apply_logra(model, rank=16, targets=("0", "2"), seed=4, runtime=runtime)
        optimizer = logra.LoGRAOptimizer(handle, lr=1e-2, offload_moments=use_runtime)
        x = torch.randn(32, 96, generator=torch.Generator().manual_seed(0)).cuda()
        for _ in range(4):
            model(x).square().mean().backward()
            optimizer.step()
        torch.cuda.synchronize()
        if use_runtime:
            space = handle.states.storage.spaces["sketch"]
            assert space.pointer <= handle.layers[0].sketch.data_ptr() < space.pointer + space.page_bytes * space.page_count
            assert runtime.stats()["clients"][0]["bytes_gpu_to_host"] > 0
        results.append([layer.weight.detach().cpu() for layer in handle.layers])
    for plain, paged in zip(*results):
        assert torch.equal(plain, paged)


@pytest.mark.parametrize("exact", [True, False], ids=["exact-kernel", "tensor-core"])
def test_a_shard_of_a_bf16_weight_rounds_as_its_rows_of_the_whole_matrix_on_gpu(exact):
    """Note [Sharded frozen weights]: the shifted rounding seed gives a row shard the bits those
    rows get in the whole matrix, with both CUDA update kernels."""
    torch.manual_seed(5)
    rows, columns, rank = 96, 512, 32
    weight = (torch.randn(rows, columns) * 0.05).to(torch.bfloat16).cuda()
    update = (torch.randn(rows, rank) * 1e-3).cuda()
    key = ops.ProjectionKey(11, 2, 0)
    seed = ops.rounding_seed_for(11, 3)
    whole = weight.clone()
    ops.fused_update_(whole, update, 1.0, key, seed, exact=exact)
    parts = []
    for first, count in [(0, 40), (40, 8), (48, 48)]:
        part = weight[first: first + count].clone()
        ops.fused_update_(part, update[first: first + count].contiguous(), 1.0, key, seed, exact=exact,
                          first_element=first * columns)
        parts.append(part)
    assert int((whole != weight).sum()) > 0
    assert torch.equal(torch.cat(parts), whole)
