"""LoGRA sketches and Adam moments as pages of membar.runtime.Runtime: embedded (host backend)
and through a real membard, with and without offloading the moments between updates."""
import pytest
import torch
import torch.nn as nn

from membar import logra
from membar.logra.state import LoGRAStates
from membar.runtime import Runtime


def _train(runtime=None, offload=False, updates=4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 300), nn.Tanh(), nn.Linear(300, 40), nn.Tanh(), nn.Linear(40, 24))
    handle = logra.apply_logra(model, rank=8, targets=("0", "2", "4"), seed=3, runtime=runtime or None)
    optimizer = logra.LoGRAOptimizer(handle, lr=1e-2, offload_moments=offload)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(updates):
        model(x).square().mean().backward()
        optimizer.step()
    return handle, optimizer


def _check_runtime_states(runtime):
    reference, _ = _train()
    handle, optimizer = _train(runtime=runtime, offload=True)
    for mine, theirs in zip(handle.layers, reference.layers):
        assert torch.equal(mine.weight, theirs.weight), "runtime pages and offloading must not change the math"
    # The sketches live in the runtime's sketch space (peeked: asking for one to accumulate into
    # would start bringing the moments back).
    spaces = handle.states.storage.spaces
    assert sorted(spaces) == ["first_moment", "second_moment", "sketch"]
    start = runtime._native.space_pointer(spaces["sketch"].id, "gpu")
    for layer in handle.layers:
        assert start <= layer.sketch.data_ptr() < start + spaces["sketch"].page_bytes * spaces["sketch"].page_count
    # Between updates the moments sit in host memory only; the sketches stay resident.
    client = runtime.stats()["clients"][0]
    by_name = {entry["name"]: entry for entry in runtime.stats()["spaces"]}
    for kind in ("first_moment", "second_moment"):
        entry = by_name[f"logra.{kind}"]
        assert entry["bytes_gpu"] == 0 and entry["bytes_both"] == 0 and entry["bytes_host"] > 0
    assert by_name["logra.sketch"]["bytes_host"] == 0 and by_name["logra.sketch"]["bytes_none"] == 0
    moment_bytes = 2 * 4 * handle.states.numel
    assert client["bytes_gpu_to_host"] >= 4 * moment_bytes  # offloaded after each of the 4 updates
    # The next backward starts bringing them back; the step finds them resident.
    x = torch.randn(16, 64)
    handle.model(x).square().mean().backward()
    before = runtime.stats()["clients"][0]["bytes_host_to_gpu"]
    assert before >= 3 * moment_bytes
    # (The first moment is reset at every redraw of A; the second carries over.)
    second = optimizer.moment("second_moment", 1)
    moments = runtime._native.space_pointer(spaces["second_moment"].id, "gpu")
    assert second.abs().sum() > 0 and moments <= second.data_ptr() < moments + 4 * handle.states.numel
    optimizer.step()
    assert optimizer.state_bytes() == 3 * 4 * handle.states.numel
    handle.states.close()
    assert runtime.stats()["spaces"] == []


def test_states_as_pages_of_an_embedded_runtime_with_offloaded_moments():
    runtime = Runtime.connect(embedded=True, backend="host", gpu_pool_bytes=8 << 20, host_pool_bytes=8 << 20)
    _check_runtime_states(runtime)


def test_flat_states_give_views_at_fixed_offsets_and_offload_round_trips():
    states = LoGRAStates([(5, 3), (7, 2)], "cpu")
    assert not states.allocated("sketch")
    views = states.views("first_moment")
    assert [tuple(v.shape) for v in views] == [(5, 3), (7, 2)]
    assert views[1].data_ptr() == views[0].data_ptr() + 15 * 4
    views[1].copy_(torch.arange(14.0).view(7, 2))
    states.offload(["first_moment"])
    assert states.peek("first_moment", 1) is None and states.allocated("first_moment")
    assert torch.equal(states.view("first_moment", 1), torch.arange(14.0).view(7, 2))
    assert states.nbytes() == 4 * 29
    with pytest.raises(ValueError, match="unknown flat LoGRA state kind"):
        states.flat("master")


def test_runtime_on_another_device_type_is_refused():
    runtime = Runtime.connect(embedded=True, backend="host", gpu_pool_bytes=8 << 20, host_pool_bytes=8 << 20)
    model = nn.Sequential(nn.Linear(8, 8)).to("meta")
    with pytest.raises(ValueError, match="runtime's pages live on cpu but the weights on meta"):
        logra.apply_logra(model, rank=2, targets=("0",), runtime=runtime)


def test_states_as_pages_of_a_daemon_with_offloaded_moments(membard, monkeypatch):
    socket = membard()
    runtime = Runtime.connect(socket=socket, embedded=False, name="logra-states")
    assert runtime.describe().startswith("daemon:")
    _check_runtime_states(runtime)
    # runtime="auto" takes the daemon when one answers.
    monkeypatch.setenv("MEMBAR_SOCKET", socket)
    handle = logra.apply_logra(nn.Sequential(nn.Linear(16, 16)), rank=4, targets=("0",), runtime="auto")
    assert handle.states.storage.describe().startswith("runtime pages (daemon:")
    handle.states.close()


def test_auto_runtime_falls_back_to_an_embedded_one_sized_for_the_states(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMBAR_SOCKET", str(tmp_path / "nobody.sock"))
    model = nn.Sequential(nn.Linear(64, 3000))
    handle = logra.apply_logra(model, rank=200, targets=("0",), runtime="auto")  # 2.4 MB per kind
    assert handle.states.storage.describe().startswith("runtime pages (embedded")
    assert handle.states.storage.runtime.stats()["clients"][0]["gpu_quota_bytes"] >= 3 * 4 * 3000 * 200
    handle.model(torch.randn(4, 64)).sum().backward()
    optimizer = logra.LoGRAOptimizer(handle, lr=1e-3)
    optimizer.step()
    assert optimizer.moment("second_moment", 0).abs().sum() > 0
    with pytest.raises(ValueError, match="runtime must be"):
        logra.apply_logra(nn.Sequential(nn.Linear(4, 4)), rank=2, targets=("0",), runtime="daemon please")
