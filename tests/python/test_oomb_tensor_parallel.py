"""Head (tensor) parallel chunk-recurrent training over torch.distributed (gloo on the CPU): the
ranks' split gradients, gathered, equal one process's full-sequence gradients, alone and beside data
parallel (Note [Head parallel layers] in membar/oomb/tensor_parallel.py); membar-train's
--tensor-parallel computes the update of one process."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from test_oomb_distributed import (TRAIN, free_port, rank_env, relative_error, run_ranks,  # noqa: F401
                                   train_ranks)

from dist_common import TOKENS, global_batch, split_config, split_model


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def reference(family: str, rows: int):
    model = split_model(family)
    batch = global_batch(rows)
    loss = model(batch, labels=batch).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(batch[:1]).logits[0, [5, TOKENS - 1]].float()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
    clipped = {name: p.grad for name, p in model.named_parameters()}
    return float(loss.detach()), grads, norm, clipped, model.state_dict(), logits


@pytest.mark.parametrize("family,world,size", [("qwen2", 2, 2), ("qwen3", 4, 4), ("qwen3", 4, 2), ("gemma2", 2, 2),
                                                ("qwen3_moe", 2, 2), ("phi3", 2, 2)],
                         ids=["qwen2-tp2", "qwen3-tp4", "qwen3-tp2-dp2", "gemma2-tp2", "qwen3_moe-tp2", "phi3-tp2"])
def test_split_heads_give_full_sequence_gradients(tmp_path, family, world, size):
    results = run_ranks("tensor", world, tmp_path, str(size), family, "dense")
    loss, grads, norm, clipped, state, logits = reference(family, world // size)
    full = split_model(family).model.layers[0]
    for rank, result in enumerate(results):
        # Each rank holds its share of the heads and of the MLP, and only its pages.
        if hasattr(full.self_attn, "qkv_proj"):   # Phi-3: its block of each of q, k and v
            assert result["kv_heads"] == full.self_attn.num_key_value_heads // size
            assert result["q_rows"] == full.self_attn.qkv_proj.out_features // size
        else:
            assert result["kv_heads"] == full.self_attn.k_proj.out_features // full.self_attn.head_dim // size
            assert result["q_rows"] == full.self_attn.q_proj.out_features // size
        if isinstance(getattr(full.mlp, "down_proj", None), torch.nn.Linear):
            assert result["down_columns"] == full.mlp.down_proj.in_features // size
        else:   # MoE: every expert's intermediate size splits (Note [Split experts])
            assert result["whole_mlps"] == []
            assert result["expert_columns"] == full.mlp.experts.down_proj.shape[2] // size
        # The vocabulary splits where the ranks divide it (Note [Vocabulary split]).
        vocab = split_model(family).get_input_embeddings().weight.shape[0]
        assert result["vocab_split"] == (vocab % size == 0)
        assert result["embedding_rows"] == (vocab // size if vocab % size == 0 else vocab)
        assert result["loss"] == pytest.approx(loss, rel=1e-5), rank
        for name, grad in grads.items():
            assert relative_error(result["grads"][name], grad) <= 1e-4, (rank, name)
        assert result["norm"] == pytest.approx(norm, rel=1e-5)
        for name, grad in clipped.items():
            assert relative_error(result["clipped"][name], grad) <= 1e-4, (rank, name)
        assert result["state"].keys() == state.keys()
        for name, tensor in state.items():
            assert torch.equal(result["state"][name], tensor), name
        assert relative_error(result["logits"], logits) <= 1e-4


def _one_process_and_two_ranks(tmp_path, options: list[str]):
    """membar-train alone and with --tensor-parallel 2: (one's summary, rank 0's summary, one's saved
    parameters, the two ranks' saved parameters), after checking that the losses agree."""
    from transformers import AutoModelForCausalLM

    single = subprocess.run([sys.executable, "-m", "membar.train", *TRAIN, *options, "--save", str(tmp_path / "one")],
                            env=rank_env(0, 1, free_port()), capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    ranks = train_ranks(2, [[*TRAIN, *options, "--tensor-parallel", "2", "--save", str(tmp_path / "two")]] * 2)
    for rank, done in enumerate(ranks):
        assert done.returncode == 0, f"rank {rank}: {done.stderr}"
    one, two = json.loads(single.stdout.splitlines()[-1]), json.loads(ranks[0].stdout.splitlines()[-1])
    assert (two["world_size"], two["tensor_parallel"], two["global_batch"]) == (2, 2, 1)
    assert [s["loss"] for s in two["steps"]] == pytest.approx([s["loss"] for s in one["steps"]], rel=1e-5)
    a = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "one").named_parameters())
    b = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "two").named_parameters())
    assert a.keys() == b.keys()
    for name, parameter in a.items():
        assert b[name].shape == parameter.shape, name   # the saved model is whole
    return one, two, a, b


def test_membar_train_split_over_two_ranks_computes_the_update_of_one_process(tmp_path):
    # Offloaded pages and recomputed layers too: neither changes the update.
    _, _, a, b = _one_process_and_two_ranks(tmp_path, ["--steps", "3", "--offload", "--checkpoint-layers"])
    for name, parameter in a.items():
        # Adam divides by the gradient's RMS: an element with a tiny gradient keeps its rounding
        # difference (split products are summed in another order), up to a few thousandths of lr.
        assert torch.allclose(b[name], parameter, rtol=1e-4, atol=1e-5), name


def test_tensor_parallel_needs_ranks_and_dividing_heads(tmp_path):
    alone = subprocess.run([sys.executable, "-m", "membar.train", *TRAIN, "--steps", "1", "--tensor-parallel", "2"],
                           env=rank_env(0, 1, free_port()), capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2
    assert alone.stderr.strip().splitlines()[-1] == (
        "membar-train: --tensor-parallel 2 splits the model over 2 ranks: start under torchrun --nproc_per_node 2 "
        "(or a multiple).")
    ranks = train_ranks(3, [[*TRAIN, "--steps", "1", "--tensor-parallel", "3"]] * 3)
    for rank, done in enumerate(ranks):
        assert done.returncode == 2, f"rank {rank}: {done.stderr}"
        assert "--tensor-parallel 3 splits the query heads over 3 ranks, but there are 4" in done.stderr, done.stderr


@pytest.mark.parametrize("size", [4])
def test_split_heads_in_sparse_mode_select_the_pages_of_one_process(tmp_path, size):
    """Note [Page selection over split heads]: every rank selects the pages one process selects
    from all heads, so the gradients equal one process's sparse gradients."""
    from membar.oomb import OOMBTrainer

    results = run_ranks("tensor", size, tmp_path, str(size), "qwen3", "sparse")
    model = split_model("qwen3")
    trainer = OOMBTrainer(model, split_config("sparse"))
    batch = global_batch(1)
    loss = trainer.step(batch)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    chosen = {key: value for key, value in trainer.last_selections.items() if value is not None}
    assert chosen, "the sequence is long enough for top-2 of its history pages to be a choice"
    for result in results:
        for key, selection in chosen.items():
            assert torch.equal(result["selections"][key].cpu(), selection.cpu()), key
        assert result["loss"] == pytest.approx(loss, rel=1e-5)
        for name, grad in grads.items():
            assert relative_error(result["grads"][name], grad) <= 1e-4, name


@pytest.mark.parametrize("tokens,pages,top_k", [(96, 9, 2), (100, 5, 8), (33, 40, 7)])
def test_split_page_select_of_one_rank_is_the_kernels_selection(tokens, pages, top_k):
    """With the whole group in one process, the summed scores are the kernel's own: the same
    pages per tile, in the same format (ascending, -1 padded when top_k exceeds the pages)."""
    import torch.distributed as dist

    from membar import attention
    from membar.oomb.tensor_parallel import split_page_select

    store = dist.HashStore()
    group = dist.ProcessGroupGloo(store, 0, 1) if hasattr(dist, "ProcessGroupGloo") else None
    if group is None:
        pytest.skip("this PyTorch has no gloo")
    generator = torch.Generator().manual_seed(tokens + pages)
    q = torch.randn(tokens, 8, 16, generator=generator)
    mean = torch.randn(pages, 4, 16, generator=generator)
    for tile in (32, 128):
        want = attention.page_select(q, mean, top_k=top_k, query_tile_tokens=tile)
        got = split_page_select(q, mean, top_k, tile, group)
        assert torch.equal(got, want), (tile, got, want)


def test_membar_train_logra_split_over_two_ranks_updates_as_one_process(tmp_path):
    """--optimizer logra with --tensor-parallel 2 (Note [LoGRA over split heads]): the same losses and
    saved weights as one process (float32; bf16 rounding is checked bit for bit in
    test_split_logra_updates_round_as_the_whole_matrix). q/k/v and gate/up keep rows, o_proj and
    down_proj columns (their P summed over the group)."""
    options = ["--steps", "3", "--optimizer", "logra", "--logra-rank", "4", "--lr", "1e-2", "--dtype", "float32"]
    one, two, a, b = _one_process_and_two_ranks(tmp_path, options)
    assert two["optimizer"] == one["optimizer"] == "logra"
    for name, parameter in a.items():
        assert torch.allclose(b[name], parameter, rtol=1e-5, atol=1e-6), name


def _split_layer(weight: torch.Tensor, split, seed_state):
    """A LoGRA layer over `weight` marked with `split` (as shard_model marks a rank's part)."""
    from membar import logra
    from membar.collectives import mark_split

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    mark_split(linear.weight, split)
    if split.dim == 1:
        linear.reduce = lambda partial: partial
    return logra.LoGRALinear(linear, 4, 7, seed_state)


@pytest.mark.parametrize("sections", [(), (16, 8, 8)], ids=["rows", "sections"])
def test_split_logra_updates_round_as_the_whole_matrix(sections):
    """Note [LoGRA over split heads]: a rank's rows (or its block of each section) of a bf16 weight
    get exactly the bits those rows of the whole matrix get from the same stochastically rounded
    update; a rank's columns get the whole update's columns (in fp32 masters)."""
    from membar import logra
    from membar.collectives import WeightSplit
    from membar.logra.linear import KeyState
    from membar.logra import ops

    generator = torch.Generator().manual_seed(5)
    whole = (torch.randn(32, 24, generator=generator) * 0.1).to(torch.bfloat16)
    update = torch.randn(32, 4, generator=generator) * 1e-2
    key_state = KeyState(seed=3)
    reference = whole.clone()
    seed = ops.rounding_seed_for(3, 0)
    ops.fused_update_(reference, update, 1.0, key_state.key(7), seed)
    size = 2
    for rank in range(size):
        split = WeightSplit(None, rank, size, 0, sections)
        if sections:
            rows = [r for offset, total in zip((0, 16, 24), sections)
                    for r in range(offset + rank * total // size, offset + (rank + 1) * total // size)]
        else:
            rows = list(range(rank * 16, rank * 16 + 16))
        layer = _split_layer(whole[rows], split, key_state)
        handle = logra.LoGRAModel(model=layer, layers=[layer], key_state=key_state)
        optimizer = logra.LoGRAOptimizer(handle, lr=1.0, algorithm="sgd")
        optimizer._apply_split(layer, update[rows].contiguous(), seed)
        assert torch.equal(layer.weight, reference[rows]), rank
    # Columns: fp32 masters (made for a bf16 weight), W_cols -= U A_cols.
    exact = whole.float().clone()
    ops.fused_update_(exact, update, 1.0, key_state.key(7))
    for rank in range(size):
        layer = _split_layer(whole[:, rank * 12: rank * 12 + 12], WeightSplit(None, rank, size, 1), key_state)
        assert layer.master is not None and layer.whole_in_features == 24
        handle = logra.LoGRAModel(model=layer, layers=[layer], key_state=key_state)
        logra.LoGRAOptimizer(handle, lr=1.0, algorithm="sgd")._apply_split(layer, update, seed)
        assert torch.allclose(layer.master, exact[:, rank * 12: rank * 12 + 12], rtol=1e-5, atol=1e-7), rank
        assert torch.equal(layer.weight, layer.master.to(torch.bfloat16))


def test_split_logra_refuses_what_it_cannot_do_exactly():
    from membar import logra
    from membar.collectives import WeightSplit
    from membar.logra.linear import KeyState

    key_state = KeyState(seed=3)
    layer = _split_layer(torch.zeros(8, 8), WeightSplit(None, 0, 2, 1), key_state)
    handle = logra.LoGRAModel(model=layer, layers=[layer], key_state=key_state)
    with pytest.raises(ValueError, match="predicted-KL step control is not supported on a head-parallel"):
        logra.LoGRAOptimizer(handle, lr=1.0, kl_control=logra.KLControl())
    with pytest.raises(ValueError, match="publishing updates from a head-parallel"):
        logra.LoGRAOptimizer(handle, lr=1.0, publisher=object())
