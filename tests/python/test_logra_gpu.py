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


@pytest.mark.parametrize("in_features", [1000, 4096, 9000])
def test_tensor_core_projection_matches_cpu_within_rounding(in_features):
    torch.manual_seed(4)
    key = ops.ProjectionKey(9, 3, 1)
    x = torch.randn(2, 300, in_features).to(torch.bfloat16)
    reference = x.double() @ logra.generate(key, 64, in_features).double().t()
    gpu = logra.project(x.cuda(), key, 64).cpu()
    assert gpu.shape == (2, 300, 64) and gpu.dtype == torch.bfloat16
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
    logra.fused_update_(weight_gpu, update.cuda(), 0.01, key)
    assert torch.equal(weight, weight_gpu.cpu())


def test_stochastic_rounding_bit_identical_to_cpu():
    torch.manual_seed(5)
    key = ops.ProjectionKey(5, 8, 2)
    weight = torch.randn(200, 700).to(torch.bfloat16)
    update = torch.randn(200, 32) * 1e-3
    weight_gpu = weight.cuda()
    seed = ops.rounding_seed_for(3, 17)
    logra.fused_update_(weight, update, 0.1, key, seed)
    logra.fused_update_(weight_gpu, update.cuda(), 0.1, key, seed)
    assert torch.equal(weight, weight_gpu.cpu())


def test_sketch_accumulate_bf16_on_gpu_matches_reference():
    torch.manual_seed(2)
    sketch = torch.randn(1536, 64, device="cuda")
    initial = sketch.clone()
    grad_output = torch.randn(4, 2048, 1536, device="cuda", dtype=torch.bfloat16)
    projected = torch.randn(4, 2048, 64, device="cuda", dtype=torch.bfloat16)
    logra.sketch_accumulate_(sketch, grad_output, projected)
    reference = initial + grad_output.float().reshape(-1, 1536).t() @ projected.float().reshape(-1, 64)
    torch.testing.assert_close(sketch, reference, rtol=1e-3, atol=1e-2)


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
