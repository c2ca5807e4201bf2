"""OOMB pages in membar's runtime (embedded, host backend): offloading pages through a small GPU
budget changes no gradient bit, pages of any size work, and streamed history matches one call over
the whole history; every run is checked against full-sequence training."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from membar.oomb import OOMBConfig, OOMBTrainer
from membar.oomb.runtime_store import RuntimeKVStore

_MIB = 1 << 20


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def model_for_runtime(kind: str, head_dim: int = 64, kv_heads: int = 2, q_heads: int = 4):
    torch.manual_seed(0)
    common = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, intermediate_size=128, vocab_size=97, attn_implementation="sdpa")
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    return LlamaForCausalLM(LlamaConfig(**common))


def grads_after(model, input_ids, store, page_tokens=128, **options):
    model.zero_grad()
    trainer = OOMBTrainer(model, OOMBConfig(page_tokens=page_tokens, deterministic=True, **options), store=store)
    loss = trainer.step(input_ids)
    grads = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad()
    return loss, grads, trainer


def full_sequence_grads(model, input_ids):
    model.zero_grad()
    model(input_ids, labels=input_ids).loss.backward()
    grads = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad()
    return grads


def max_relative_error(grads, reference) -> float:
    return max(float((grads[name] - ref).abs().max() / ref.abs().max()) for name, ref in reference.items())


@pytest.mark.parametrize("kind,mode", [("qwen2", "dense"), ("llama", "dense"), ("qwen2", "sparse")])
def test_offload_through_a_small_budget_changes_no_gradient_bit(kind, mode):
    """Pages leaving for the host tier and coming back change no bit."""
    # Pages of 128 tokens x 4 KV heads x 256 dims in float32 (512 KiB): 9 pages per space, 3 frames;
    # 24 frames in all against a 24 MiB budget, so every layer's pages leave and come back.
    model = model_for_runtime(kind, head_dim=256, kv_heads=4)
    input_ids = torch.randint(0, 97, (1, 1100), generator=torch.Generator().manual_seed(1))
    options = dict(chunk_tokens=128, mode=mode, top_k=1, query_tile_tokens=64, history_block_tokens=256)
    _, resident, _ = grads_after(model, input_ids, RuntimeKVStore("cpu"), **options)
    if mode == "dense":
        assert max_relative_error(resident, full_sequence_grads(model, input_ids)) <= 2e-5
    # Offloaded layers stream their history in blocks: the same blocks through a budget that holds
    # every page, and through one that does not, give the same bits.
    loss, reference, _ = grads_after(model, input_ids, RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=1 << 30),
                                     **options)
    assert max_relative_error(reference, resident) <= 2e-5
    store = RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=24 * _MIB)
    loss_offload, grads, trainer = grads_after(model, input_ids, store, **options)
    assert loss_offload == loss
    for name in reference:
        assert torch.equal(grads[name], reference[name]), f"{name} differs with offload"
    assert trainer.stats["pages_to_host"] > 0
    if mode == "dense":   # (top_k=1 may never read an evicted page again)
        assert trainer.stats["pages_to_device"] > 0
    # Frames were mapped on the thread that delivered the events; the same step with maps on the
    # client's mapping thread (MEMBAR_ASYNC_MAPS=1, Note [Maps off the caller's thread]) gives the same bits.
    assert not store.stats.async_maps and store.stats.map_runs > 0 and store.stats.map_apply_ns > 0
    if (kind, mode) in (("qwen2", "dense"), ("qwen2", "sparse")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MEMBAR_ASYNC_MAPS", "1")
            asynchronous = RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=24 * _MIB)
            _, grads_async, _ = grads_after(model, input_ids, asynchronous, **options)
            assert asynchronous.stats.async_maps and asynchronous.stats.map_runs > 0
        for name in reference:
            assert torch.equal(grads_async[name], reference[name]), f"{name} differs with the mapping thread"
    # A second step reuses the spaces and frees every page it wrote.
    grads_after(model, input_ids, store, **options)
    assert store.stats.pages_live["current"] == 0


def test_resident_layers_leave_no_host_pool_behind_them():
    """With gpu_resident_layers the host tier is sized for the other layers' pages and the streamed
    working set, not for every page (store_sizes): a 4-layer model with 2 layers resident trains
    through that smaller host pool with the bits of a budget that holds every page."""
    # Pages of 16 tokens x 32 KV heads x 256 dims in float32 (512 KiB), 28 of them per space, in
    # chunks of 4 pages and history blocks of 2: the pages, frames, chunks and blocks of 3500 tokens
    # in 128-token pages of 4 heads, for an eighth of the tokens. The CPU attention's work grows with
    # the square of the tokens and only linearly with the heads: on the 2-core CI machine this test
    # took 157 s with that shape and takes 54 s with this one.
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=128, num_hidden_layers=4, num_attention_heads=32,
                                         num_key_value_heads=32, head_dim=256, intermediate_size=128, vocab_size=97,
                                         attn_implementation="sdpa"))
    input_ids = torch.randint(0, 97, (1, 438), generator=torch.Generator().manual_seed(1))
    options = dict(page_tokens=16, chunk_tokens=64, history_block_tokens=32)
    _, reference, _ = grads_after(model, input_ids, RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=1 << 30),
                                  **options)
    store = RuntimeKVStore("cpu", offload=True, gpu_resident_layers=2)
    _, grads, trainer = grads_after(model, input_ids, store, **options)
    for name in reference:
        assert torch.equal(grads[name], reference[name]), f"{name} differs with 2 resident layers"
    assert trainer.stats["pages_to_host"] > 0
    # Every page: 4 layers x K, V, dK, dV, each 28 float32 pages of 16 x 32 x 256 x 4 bytes = 512 KiB
    # (7 frames), 112 frames. The host tier: the 2 streamed layers' 56 frames, a working set of 5
    # blocks of 2 pages (one frame) in each of the 4 spaces and 2 frames of slack, 78 frames.
    every_page = 4 * 4 * _frames(28 * 512 * 1024) * 2 * _MIB
    host = next(tier for tier in store.runtime.stats()["tiers"] if tier["tier"] == "host")
    assert host["frames_total"] * 2 * _MIB < 0.8 * every_page
    assert 0 < host["frames_used"] <= host["frames_total"]


def test_pools_larger_than_the_machine_are_a_sentence_before_anything_is_pinned(monkeypatch):
    """A store whose own pools would not fit the host's available memory says so before pinning
    (pinning them would have the OOM killer stop the process, as Gemma-2-9B at 128K did)."""
    import membar.oomb.config as config

    model = model_for_runtime("qwen2", head_dim=256, kv_heads=4)
    input_ids = torch.randint(0, 97, (1, 1100), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(config, "host_available_bytes", lambda: 32 * _MIB)
    store = RuntimeKVStore("cpu", offload=True, gpu_resident_layers=1)
    with pytest.raises(ValueError, match=r"would pin .* of host memory .* more than 92% of the 32.0 MiB this machine "
                                         r"has available: keep more layers on the GPU"):
        grads_after(model, input_ids, store, chunk_tokens=128)
    assert store.runtime is None


def _frames(nbytes: int) -> int:
    return -(-nbytes // (2 * _MIB))


@pytest.mark.parametrize("mode,checkpoint,kinds", [("dense", False, "1"), ("dense", True, "1"), ("sparse", False, "1"),
                                                   ("dense", True, "kv"), ("sparse", False, "kv")])
def test_staged_history_gives_the_same_bits_with_fewer_placements(mode, checkpoint, kinds):
    """Note [Staged history]: history blocks copied through staging rows (copy_pages), ahead of use,
    give the bits of blocks acquired as the history's own pages, through a GPU budget smaller than
    the pages; two steps in a row (the second reuses the staging rows); with layer checkpointing a
    block read by a layer's recompute and then its backward is copied once. In sparse mode selections
    copy only their pages into the slot's first rows (page_map numbers them)."""
    model = model_for_runtime("qwen2", head_dim=256, kv_heads=4)
    input_ids = torch.randint(0, 97, (1, 1100), generator=torch.Generator().manual_seed(2))
    options = dict(chunk_tokens=128, mode=mode, top_k=1, query_tile_tokens=64, history_block_tokens=512,
                   checkpoint_layers=checkpoint)
    _, resident, _ = grads_after(model, input_ids, RuntimeKVStore("cpu"), **options)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMBAR_STAGED_HISTORY", "0")
        acquired = RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=36 * _MIB)
        _, plain, _ = grads_after(model, input_ids, acquired, **options)
    assert acquired._staging is None
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMBAR_STAGED_HISTORY", kinds)   # "kv": K/V staged, dK/dV acquired in place
        staged = RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=36 * _MIB)
    for step in range(2):
        _, grads, _ = grads_after(model, input_ids, staged, **options)
        assert staged._staging is not None
        for name in resident:
            assert torch.equal(grads[name], plain[name]), f"{name} differs with staged history (step {step})"
        # Blocks sum in another order than one call over the whole history: equal to rounding.
        assert max_relative_error(grads, resident) <= 2e-5
    stats = staged.stats
    assert staged._staging.hits > 0 and stats.prefetch_hits > stats.prefetch_misses   # copies issued ahead
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMBAR_STAGED_HISTORY", "yes")
        with pytest.raises(ValueError, match="MEMBAR_STAGED_HISTORY"):
            RuntimeKVStore("cpu", offload=True)
    if checkpoint:   # a layer's recompute and backward read one block one after the other: one copy
        assert staged._staging.shared > 0
    if mode == "sparse" and kinds != "kv":   # selections copy their pages only (not their frames)
        assert staged._staging.selections > 0
    assert stats.pages_live["current"] == 0


@pytest.mark.parametrize("head_dim,page_tokens,tokens,budget_mib", [(96, 48, 3000, 24), (40, 24, 300, None)])
def test_pages_of_any_size(head_dim, page_tokens, tokens, budget_mib):
    """Pages of 72 KiB (frames of 2 MiB hold 28.4 of them, so pages straddle frames) offloaded
    through a budget below the sequence's pages, and of 15 KiB kept resident."""
    model = model_for_runtime("qwen2", head_dim=head_dim, kv_heads=4)
    input_ids = torch.randint(0, 97, (1, tokens), generator=torch.Generator().manual_seed(3))
    reference = full_sequence_grads(model, input_ids)
    options = dict(chunk_tokens=4 * page_tokens, page_tokens=page_tokens, history_block_tokens=2 * page_tokens)
    _, resident, _ = grads_after(model, input_ids, RuntimeKVStore("cpu"), **options)
    assert max_relative_error(resident, reference) <= 2e-5
    if budget_mib is None:
        return
    store = RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=budget_mib * _MIB)
    _, offloaded, trainer = grads_after(model, input_ids, store, **options)
    assert trainer.stats["pages_to_host"] > 0
    assert max_relative_error(offloaded, reference) <= 2e-5


def test_a_budget_below_one_access_is_a_clear_error():
    model = model_for_runtime("qwen2", head_dim=256, kv_heads=4)
    store = RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=1 << 20)
    trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=128, page_tokens=128, history_block_tokens=0), store=store)
    with pytest.raises(ValueError, match="cannot hold what one step acquires at once"):
        trainer.step(torch.randint(0, 97, (1, 2048)))


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_runtime_pages_streamed_in_blocks(mode):
    """With offload, the layers stream their history one page-block at a time: the gradients equal
    those of one call over the whole history up to float32 rounding."""
    model = model_for_runtime("qwen2", head_dim=256, kv_heads=4)
    input_ids = torch.randint(0, 97, (1, 1100), generator=torch.Generator().manual_seed(2))
    options = dict(chunk_tokens=128, mode=mode, top_k=2, query_tile_tokens=64, history_block_tokens=0)
    _, reference, _ = grads_after(model, input_ids, RuntimeKVStore("cpu"), **options)
    store = RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=24 * _MIB)
    options["history_block_tokens"] = 256
    _, grads, trainer = grads_after(model, input_ids, store, **options)
    assert max_relative_error(grads, reference) <= 2e-5
    assert trainer.stats["pages_to_host"] > 0
    if mode == "dense":
        assert trainer.stats["prefetch_hits"] > 0
    assert store.stats.pages_live["current"] == 0


@pytest.mark.parametrize("query_tile_tokens,block_tokens,one_call", [(128, 256, True), (32, 128, False)])
def test_a_sparse_selection_that_fits_a_block_is_read_in_one_call(query_tile_tokens, block_tokens, one_call):
    """Note [Streaming a layer's history]: with offload, a sparse selection whose pages touch no
    more frames than a history block is read in one call over the whole history (one access per
    layer, chunk and phase, not one per block holding a selected page); one that touches more is
    streamed block by block. Both give the gradients of the resident one-call path."""
    # Pages of 512 KiB (4 per frame). One query tile of 128 and top-2: at most 2 pages, which touch
    # at most the 2 frames a 2-page block can span. Tiles of 32 (4 x top-2 = up to 8 pages) against
    # 1-page blocks (1 frame): streamed wherever the selection reaches into two frames.
    model = model_for_runtime("qwen2", head_dim=256, kv_heads=4)
    input_ids = torch.randint(0, 97, (1, 1100), generator=torch.Generator().manual_seed(6))
    options = dict(chunk_tokens=128, mode="sparse", top_k=2, query_tile_tokens=query_tile_tokens,
                   history_block_tokens=0)
    _, reference, _ = grads_after(model, input_ids, RuntimeKVStore("cpu"), **options)
    plans = []

    class Recording(RuntimeKVStore):
        def plan(self, accesses):
            super().plan(accesses)
            plans.append(list(accesses))

    store = Recording("cpu", offload=True, gpu_budget_bytes=24 * _MIB)
    options["history_block_tokens"] = block_tokens
    _, grads, trainer = grads_after(model, input_ids, store, **options)
    assert max_relative_error(grads, reference) <= 2e-5
    assert store.stats.pages_live["current"] == 0
    backward = {}
    for access in plans[-1]:   # stage 2's plan: every chunk's accesses
        if access.kind == "kv" and access.phase == "backward":
            backward.setdefault((access.layer, access.chunk), []).append(access)
    selected = {key: accesses for key, accesses in backward.items() if key[1] > 2}   # history > top_k pages
    assert selected
    if one_call:
        for (layer, chunk), accesses in selected.items():
            assert len(accesses) == 1, (layer, chunk, accesses)
            assert (accesses[0].first_page, accesses[0].num_pages) == (0, chunk)
            assert 0 < len(accesses[0].selected) <= 2
    else:
        streamed = [accesses for accesses in selected.values() if len(accesses) > 1]
        assert streamed
        assert all(access.num_pages == 1 for accesses in streamed for access in accesses)


def test_the_default_budget_has_room_for_a_scattered_selection():
    """A sparse selection of a few pages, each in a frame of its own, touches more frames than a
    history block of many consecutive pages spans (7B shape: 64 pages of 128 KiB in ~60 frames of
    a 1M history, a 64K-token block spans 33): the default GPU budget is sized for as many
    scattered pages as a chunk's selection names (OOMBConfig.selection_pages), so each is read in
    one call, with the gradients of the resident path; a budget given too small for that room
    streams them block by block, as before."""
    # Pages of 32 tokens x 4 KV heads x 256 dims in float32 (128 KiB: 16 per frame); blocks of 16
    # pages span 2 frames; a chunk's selection (one tile, top-4) is up to 4 pages in up to 4 frames.
    model = model_for_runtime("qwen2", head_dim=256, kv_heads=4)
    input_ids = torch.randint(0, 97, (1, 2200), generator=torch.Generator().manual_seed(7))
    options = dict(chunk_tokens=128, page_tokens=32, mode="sparse", top_k=4, query_tile_tokens=128,
                   history_block_tokens=0)
    _, reference, _ = grads_after(model, input_ids, RuntimeKVStore("cpu"), **options)
    options["history_block_tokens"] = 512

    def backward_accesses(gpu_budget_bytes):
        plans = []

        class Recording(RuntimeKVStore):
            def plan(self, accesses):
                super().plan(accesses)
                plans.append(list(accesses))

        store = Recording("cpu", offload=True, gpu_budget_bytes=gpu_budget_bytes)
        _, grads, _ = grads_after(model, input_ids, store, **options)
        assert max_relative_error(grads, reference) <= 2e-5
        backward = {}
        for access in plans[-1]:
            if access.kind == "kv" and access.phase == "backward":
                backward.setdefault((access.layer, access.chunk), []).append(access)
        return backward, store

    backward, store = backward_accesses(None)
    beyond_a_block = 0
    for (layer, chunk), accesses in backward.items():
        assert len(accesses) == 1, (layer, chunk, accesses)
        frames = {page // 16 for page in (accesses[0].selected or ())}
        beyond_a_block += len(frames) > 2
    assert beyond_a_block > 0   # some selection would not have fit a block's 2 frames
    # 28 MiB: a block's and a chunk's frames (24 MiB), not 4 x 4 scattered ones (40 MiB): streamed.
    backward, _ = backward_accesses(28 * _MIB)
    assert any(len(accesses) > 1 for accesses in backward.values())


def test_training_through_membard_changes_no_gradient_bit(membard):
    """The same step with pages in a membard daemon (offloaded through a small budget) as in an
    embedded runtime: the same bits, and full-sequence gradients."""
    membard_socket = membard(gpu_pool="64MiB", host_pool="256MiB")
    model = model_for_runtime("qwen2", head_dim=256, kv_heads=4)
    input_ids = torch.randint(0, 97, (1, 1100), generator=torch.Generator().manual_seed(1))
    options = dict(chunk_tokens=128, history_block_tokens=256)
    loss, embedded, _ = grads_after(model, input_ids, RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=24 * _MIB),
                                    **options)
    store = RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=24 * _MIB, socket=membard_socket, name="pytest-oomb")
    daemon_loss, through_daemon, trainer = grads_after(model, input_ids, store, **options)
    assert trainer.store.runtime.describe().startswith("daemon:")
    stats = trainer.store.runtime.stats()
    client = [c for c in stats["clients"] if c["name"] == "pytest-oomb"][0]
    assert client["bytes_gpu_to_host"] > 0 and client["bytes_host_to_gpu"] > 0, "pages should have moved"
    assert float(daemon_loss) == float(loss)
    for name, grad in embedded.items():
        assert torch.equal(through_daemon[name], grad), name
    assert max_relative_error(through_daemon, full_sequence_grads(model, input_ids)) < 1e-4


def test_a_schedule_larger_than_a_request_trains_through_membard(membard):
    """Sparse mode names every selected page run in its access schedule: here 97,796 ranges (1.17 MB,
    over the 1 MiB a request carries; a 1M-token step of the 7B shape names ~2.7M). The schedule
    reaches membard in parts (Note [A schedule in parts]) and the step's bits equal the embedded
    runtime's."""
    membard_socket = membard(gpu_pool="128MiB", host_pool="512MiB")
    # One q head per kv head: the pages (and so the ranges) are those of 4 q heads, for half the
    # CPU attention (on the 2-core CI machine this test took 99 s with 4 q heads).
    model = model_for_runtime("qwen2", head_dim=64, kv_heads=2, q_heads=2)
    input_ids = torch.randint(0, 97, (1, 24576), generator=torch.Generator().manual_seed(1))
    options = dict(page_tokens=16, chunk_tokens=128, mode="sparse", top_k=64, history_block_tokens=0)
    loss, embedded, _ = grads_after(model, input_ids, RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=64 * _MIB),
                                    **options)
    planned = []

    class Counting(RuntimeKVStore):
        def plan(self, accesses):
            super().plan(accesses)
            planned.append(sum(len(self._page_runs(access)) * 2 for access in accesses))   # two spaces each

    store = Counting("cpu", offload=True, gpu_budget_bytes=64 * _MIB, socket=membard_socket, name="long-schedule")
    daemon_loss, through_daemon, trainer = grads_after(model, input_ids, store, **options)
    assert trainer.store.runtime.describe().startswith("daemon:")
    assert max(planned) * 12 > 1 << 20, f"the schedule ({max(planned)} ranges) should not fit one request"
    assert float(daemon_loss) == float(loss)
    for name, grad in embedded.items():
        assert torch.equal(through_daemon[name], grad), name


def test_two_trainer_processes_share_one_membard(membard):
    """Two membar-train processes through one daemon at once (host backend): each trains the
    losses that one embedded process trains alone."""
    membard_socket = membard(gpu_pool="64MiB", host_pool="256MiB")
    import json
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", "membar.train", "--model", "tiny-qwen2", "--device", "cpu", "--seq-len", "1K",
               "--chunk", "256", "--page-tokens", "64", "--steps", "2", "--offload", "--no-progress", "--json"]
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    environment.pop("MEMBAR_SOCKET", None)

    def losses(output: str) -> list[float]:
        return [step["loss"] for step in json.loads(output.strip().splitlines()[-1])["steps"]]

    alone = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
    assert alone.returncode == 0, alone.stderr[-2000:]
    shared = [subprocess.Popen(command + ["--socket", membard_socket], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=environment) for _ in range(2)]
    outputs = [process.communicate(timeout=300) for process in shared]
    for process, (out, err) in zip(shared, outputs):
        assert process.returncode == 0, err[-2000:]
        assert "pages in the runtime (daemon:" in out
        # The CPU kernels' sums are not ordered across threads (membar-train is not run in
        # deterministic mode): the same pages give the same losses to rounding.
        assert losses(out) == pytest.approx(losses(alone.stdout), rel=1e-5)


def test_a_private_membard_trains_the_same_bits_and_goes_away():
    """socket="private" (membar-train --socket private): the store starts a membard of its own, sized
    as an embedded runtime would be, trains through it with the same bits, and stops it on close."""
    import os

    from membar.runtime import membard_binary

    try:
        membard_binary()
    except ValueError:
        pytest.skip("membard is not built")
    model = model_for_runtime("qwen2", head_dim=256, kv_heads=4)
    input_ids = torch.randint(0, 97, (1, 1100), generator=torch.Generator().manual_seed(1))
    options = dict(chunk_tokens=128, history_block_tokens=256)
    _, embedded, _ = grads_after(model, input_ids, RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=24 * _MIB),
                                 **options)
    store = RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=24 * _MIB, socket="private")
    _, private, trainer = grads_after(model, input_ids, store, **options)
    assert trainer.store.runtime.describe().startswith("daemon:")
    daemon = store._private
    assert daemon.process.poll() is None and os.path.exists(daemon.socket)
    for name, grad in embedded.items():
        assert torch.equal(private[name], grad), name
    daemon.close()
    assert daemon.process is None and not os.path.exists(daemon.directory)


def test_membar_train_with_a_private_membard_and_nothing_left_behind(tmp_path):
    """membar-train --socket private trains the losses of the embedded runtime through a membard of
    its own; a trainer killed with SIGKILL takes its private membard with it."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from membar.runtime import membard_binary

    try:
        membard_binary()
    except ValueError:
        pytest.skip("membard is not built")
    command = [sys.executable, "-m", "membar.train", "--model", "tiny-qwen2", "--device", "cpu", "--seq-len", "1K",
               "--chunk", "256", "--page-tokens", "64", "--steps", "2", "--offload", "--no-progress", "--json"]
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    environment.pop("MEMBAR_SOCKET", None)
    runs = [subprocess.run(command + extra, capture_output=True, text=True, timeout=300, env=environment)
            for extra in ([], ["--socket", "private"])]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    assert "pages in the runtime (daemon:" in runs[1].stdout
    losses = [[s["loss"] for s in json.loads(run.stdout.strip().splitlines()[-1])["steps"]] for run in runs]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    # A trainer that dies: its private membard goes too (PR_SET_PDEATHSIG).
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                              "from membar.runtime import PrivateDaemon\n"
                              "d = PrivateDaemon('host', 8 << 20, 8 << 20)\n"
                              "print(d.process.pid, flush=True)\n"
                              "time.sleep(600)\n"], stdout=subprocess.PIPE, text=True, env=environment)
    daemon_pid = int(child.stdout.readline())
    os.kill(daemon_pid, 0)   # running
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=10)
    for _ in range(200):
        try:
            os.kill(daemon_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(daemon_pid, signal.SIGKILL)
        raise AssertionError("the private membard outlived its trainer")


def test_timed_stream_waits_count_only_finished_waits(monkeypatch):
    """MEMBAR_TIME_STREAM_WAITS=1 (the bench's "+timewaits"): the store sums the event pairs around
    its GPU-side waits whose second event has completed, keeps the rest for later, and reports -1
    when it does not time them. (The events themselves are CUDA's: here stand-ins.)"""
    class Event:
        def __init__(self, done=True, ms=0.0):
            self.done, self.ms = done, ms

        def query(self):
            return self.done

        def elapsed_time(self, other):
            return other.ms

    model = model_for_runtime("qwen2")
    input_ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(2))
    untimed = RuntimeKVStore("cpu")
    grads_after(model, input_ids, untimed, chunk_tokens=32, page_tokens=16)
    assert untimed.stats.stream_wait_ns == -1
    monkeypatch.setenv("MEMBAR_TIME_STREAM_WAITS", "1")
    store = RuntimeKVStore("cpu")
    grads_after(model, input_ids, store, chunk_tokens=32, page_tokens=16)
    assert store.stats.stream_wait_ns == 0   # on the CPU nothing waits on a stream
    host_stall = store.stats.stall_ns
    runtime_stall = store.runtime.stats()["clients"][0]["stall_ns"]
    store._wait_events = [(Event(), Event(ms=1.5), "kv:backward"), (Event(), Event(done=False, ms=9.0), "dkv:backward"),
                          (Event(), Event(ms=0.25), "kv:backward")]
    assert store.stats.stream_wait_ns == 1_750_000
    assert len(store._wait_events) == 1
    store._wait_events[0][1].done = True
    assert store.stats.stream_wait_ns == 10_750_000 and not store._wait_events
    # ... and per access kind and phase: [ns, waits, longest ns].
    assert store.stats.stream_wait_by_kind == {"kv:backward": [1_750_000, 2, 1_500_000],
                                              "dkv:backward": [9_000_000, 1, 9_000_000]}
    # The finished waits reached the runtime's stall time (what membarctl shows) once each; the
    # store's stall_ns stays the host's own.
    assert store.runtime.stats()["clients"][0]["stall_ns"] == runtime_stall + 10_750_000
    assert store.stats.stall_ns == host_stall


def test_predicted_selections_copy_ahead_and_change_no_gradient_bit(monkeypatch, membard):
    """Note [Predicted selections]: with offload, stage 1 of a sparse step copies the frames of each
    layer's previous selection ahead of the layer's own selection. More of its accesses find their
    frames on the GPU, and no gradient bit changes (a guess only ever adds copies), embedded or
    through membard (one prefetch_ranges request per guess)."""
    model = model_for_runtime("qwen2", head_dim=256, kv_heads=4)
    input_ids = torch.randint(0, 97, (1, 2200), generator=torch.Generator().manual_seed(7))
    options = dict(chunk_tokens=128, mode="sparse", top_k=2, query_tile_tokens=128, history_block_tokens=256)
    runs = {}
    for predict in ("0", "1"):
        monkeypatch.setenv("MEMBAR_PREDICT_SELECTIONS", predict)
        store = RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=24 * _MIB)
        loss, grads, trainer = grads_after(model, input_ids, store, **options)
        runs[predict] = (loss, grads, dict(trainer.stats))
    (loss_off, grads_off, off), (loss_on, grads_on, on) = runs["0"], runs["1"]
    assert loss_on == loss_off
    assert all(torch.equal(grads_on[name], grads_off[name]) for name in grads_off)
    assert off["predicted_frames"] == 0 and on["predicted_frames"] > 0
    print(f"prefetch hits {off['prefetch_hits']} -> {on['prefetch_hits']}, misses {off['prefetch_misses']} -> "
          f"{on['prefetch_misses']}, {on['predicted_frames']} frames predicted")
    assert on["prefetch_hits"] > off["prefetch_hits"] and on["prefetch_misses"] < off["prefetch_misses"]
    socket = membard(gpu_pool="64MiB", host_pool="256MiB")
    store = RuntimeKVStore("cpu", offload=True, gpu_budget_bytes=24 * _MIB, socket=socket, name="pytest-predict")
    loss_daemon, grads_daemon, trainer = grads_after(model, input_ids, store, **options)
    assert trainer.store.runtime.describe().startswith("daemon:")
    assert loss_daemon == loss_on and all(torch.equal(grads_daemon[name], grads_on[name]) for name in grads_on)
    assert trainer.stats["predicted_frames"] == on["predicted_frames"]
    assert trainer.stats["prefetch_hits"] == on["prefetch_hits"]


def test_a_chunks_own_grad_pages_are_named_by_its_last_dkv_step():
    """Note [Chunk grads with the last block]: the schedule step of a layer's last dK/dV access of a
    chunk also names the chunk's own dK/dV pages, so the lookahead brings them in with that block;
    no other step changes, and MEMBAR_CHUNK_GRADS_EARLY=0 (chunk_grads_early=False) keeps them apart."""
    from membar.oomb.kv_store import Access
    from membar.oomb.runtime_store import schedule_steps

    plan = []
    for chunk in (2, 1):   # stage 2 walks the chunks last first
        for layer in (1, 0):
            for block in range(chunk):   # one history block per earlier chunk
                plan.append(Access("kv", layer, chunk, "backward", 4 * block, 4, block=block))
                plan.append(Access("dkv", layer, chunk, "backward", 4 * block, 4, block=block))
            plan.append(Access("chunk_grad", layer, chunk, "backward", 4 * chunk, 4))

    def ranges_of(access):
        kind = {"kv": 10, "dkv": 20, "chunk_grad": 20}[access.kind]   # the dK/dV spaces are shared
        return [kind + access.layer, access.first_page, access.num_pages]

    apart, step_of = schedule_steps(plan, ranges_of, chunk_grads_early=False)
    early, step_of_early = schedule_steps(plan, ranges_of)
    assert step_of == step_of_early and len(early) == len(plan)
    assert apart == [ranges_of(access) for access in plan]
    for index, access in enumerate(plan):
        last_dkv = (access.kind == "dkv" and plan[index + 1].kind == "chunk_grad")
        if last_dkv:
            assert early[index] == ranges_of(access) + ranges_of(plan[index + 1])
        else:
            assert early[index] == apart[index]
    assert sum(len(step) for step in early) == sum(len(step) for step in apart) + 3 * 4   # 4 chunk_grads
