"""Splitting an offloading run's pages between GPU and host (plan_gpu_resident_layers,
membar-train --gpu-resident-layers) and token counts written as 128K / 1M."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from membar.oomb import plan_gpu_resident_layers
from membar.oomb.config import parse_tokens
from membar.train import main, run

GIB = 2**30


def qwen25_7b_config():
    return Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064)


def test_plan_for_one_million_tokens_of_a_7b_model():
    # 1M tokens, pages of 128, 4 KV heads x 128 dims: 8192 pages of 64K elements per layer, K + V in
    # bf16 and dK + dV in fp32: 2 x 8192 x 65536 x (2 + 4) bytes = 6 GiB per layer.
    plan = plan_gpu_resident_layers(1 << 20, qwen25_7b_config(), 128, torch.bfloat16, torch.float32,
                                    device_free_bytes=124 * GIB, reserve_bytes=30 * GIB,
                                    host_available_bytes=120 * GIB)
    assert plan.layer_bytes == 6 * GIB
    assert plan.gpu_resident_layers == 15             # (124 - 30) // 6, as the H200 1M run had
    assert plan.host_bytes == 13 * 6 * GIB             # 78 GiB of host pools, as measured there


def test_plan_keeps_everything_on_the_gpu_when_it_fits_and_never_goes_negative():
    config = qwen25_7b_config()
    everything = plan_gpu_resident_layers(32768, config, 128, torch.bfloat16, torch.float32, 100 * GIB, 30 * GIB, 0)
    assert everything.gpu_resident_layers == 28 and everything.host_bytes == 0
    nothing = plan_gpu_resident_layers(32768, config, 128, torch.bfloat16, torch.float32, 10 * GIB, 30 * GIB,
                                       100 * GIB)
    assert nothing.gpu_resident_layers == 0 and nothing.host_bytes == 28 * nothing.layer_bytes


def test_plan_names_the_numbers_when_the_host_cannot_hold_the_rest():
    with pytest.raises(ValueError, match=r"need .* GiB of host memory, more than 92% of the 100.0 GiB available"):
        plan_gpu_resident_layers(2 << 20, qwen25_7b_config(), 128, torch.bfloat16, torch.float32,
                                 device_free_bytes=124 * GIB, reserve_bytes=30 * GIB,
                                 host_available_bytes=100 * GIB)


@pytest.mark.parametrize("text, tokens", [("32768", 32768), ("128K", 131072), ("1M", 1 << 20), ("1.5k", 1536),
                                          (" 2m ", 2 << 20), (4096, 4096)])
def test_token_counts(text, tokens):
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("text", ["12Q", "", "K", "0.3K", "-1K"])
def test_bad_token_counts_get_a_sentence(text):
    with pytest.raises(ValueError, match="token count"):
        parse_tokens(text)


def test_cli_auto_residency_on_the_cpu(capsys):
    torch.set_num_threads(1)
    summary = run(["--model", "tiny-qwen2", "--seq-len", "1K", "--chunk", "256", "--page-tokens", "64",
                   "--steps", "1", "--offload", "--gpu-resident-layers", "auto",
                   "--no-progress", "--device", "cpu"])
    assert summary["seq_len"] == 1024 and len(summary["steps"]) == 1
    out = capsys.readouterr().out
    assert "pages: 0 of 2 layers on the GPU, 2 in host memory" in out


@pytest.mark.parametrize("arguments, message", [
    (["--gpu-resident-layers", "2"], "needs --offload"),
    (["--offload", "--gpu-resident-layers", "many"], "a number or 'auto'"),
    (["--offload", "--gpu-resident-layers", "-1"], ">= 0"),
])
def test_cli_bad_residency_gets_a_sentence(arguments, message, capsys):
    assert main(["--model", "tiny-qwen2", "--seq-len", "512", "--chunk", "256", "--steps", "1", "--no-progress",
                 "--device", "cpu", *arguments]) == 2
    assert message in capsys.readouterr().err


def test_cli_bad_sequence_length_gets_a_sentence(capsys):
    with pytest.raises(SystemExit):
        main(["--model", "tiny-qwen2", "--seq-len", "lots"])
    assert "not a token count" in capsys.readouterr().err


def test_offload_hint_names_membard_only_for_embedded_offload_on_a_gpu():
    from membar.train import offload_hint

    hint = offload_hint(True, "cuda:0", "embedded:cuda")
    assert "membard" in hint and "--socket" in hint
    assert offload_hint(False, "cuda:0", "embedded:cuda") == ""
    assert offload_hint(True, "cuda:0", "daemon:/run/membar/membard.sock") == ""
    assert offload_hint(True, "cpu", "embedded:host") == ""
    # Copies ordered on the device: the stream waits on the GPU in-process too (no hint).
    assert offload_hint(True, "cuda:0", "embedded:cuda", host_waits=False) == ""


def test_sparse_offload_hint_suggests_one_selection_per_chunk():
    from types import SimpleNamespace

    from membar.train import sparse_offload_hint

    args = SimpleNamespace(mode="sparse", offload=True, query_tile=128, chunk=4096, top_k=64)
    hint = sparse_offload_hint(args)
    assert "32 query tiles" in hint and "--query-tile 4096" in hint and "2048 pages" in hint
    assert sparse_offload_hint(SimpleNamespace(**{**vars(args), "query_tile": 4096})) == ""
    assert sparse_offload_hint(SimpleNamespace(**{**vars(args), "offload": False})) == ""
    assert sparse_offload_hint(SimpleNamespace(**{**vars(args), "mode": "dense"})) == ""


def test_cli_auto_residency_through_membard_plans_against_its_pools(membard, capsys):
    """Through membard the pages' memory is the daemon's pools, not this process's free memory:
    the plan asks the daemon (host backend here: its "GPU" tier holds both layers), and a host
    pool too small for the rest is one sentence naming it."""
    torch.set_num_threads(1)
    socket = membard(gpu_pool="64MiB", host_pool="64MiB")
    common = ["--model", "tiny-qwen2", "--chunk", "256", "--page-tokens", "64", "--offload",
              "--gpu-resident-layers", "auto", "--no-progress", "--device", "cpu", "--socket", socket]
    summary = run(common + ["--seq-len", "1K", "--steps", "1"])
    assert len(summary["steps"]) == 1
    out = capsys.readouterr().out
    assert "pages: 2 of 2 layers on the GPU, 0 in host memory" in out
    assert "planned against membard's pools (0.1 GiB GPU, 0.1 GiB host left)" in out
    with pytest.raises(ValueError, match="planned against membard at .*: its pools have .* start it with a larger "
                                         "--host-pool"):
        run(common + ["--seq-len", "256K", "--steps", "1"])


@pytest.mark.parametrize("tokens,selection", [(128 * 1024, 0), (1 << 20, 0), (256 * 1024, 64)])
def test_a_plan_beside_the_streamed_blocks_fits_the_stores_gpu_budget(tokens, selection):
    """The GPU budget an offloading store takes (store_sizes: the resident layers plus prefetch_depth
    + 3 streamed accesses) fits in what a plan was given once streamed_bytes is added to its reserve
    (Gemma-2-9B at 128K, session 24, ran out of GPU memory with a plan that left it out)."""
    from membar.oomb import pool_bytes_per_layer
    from membar.oomb.kv_store import PageLayout
    from membar.oomb.runtime_store import store_sizes, streamed_bytes

    config, block, depth = qwen25_7b_config(), 64 * 1024, 2
    streamed = streamed_bytes(tokens, config, 128, torch.bfloat16, torch.float32, block, depth,
                              selection_pages=selection)
    # Room for about half of the layers beside 24 GiB of activations.
    activations = 24 * GIB
    free = activations + 14 * pool_bytes_per_layer(tokens, 128, 4, 128, torch.bfloat16, torch.float32)
    plan = plan_gpu_resident_layers(tokens, config, 128, torch.bfloat16, torch.float32, free,
                                    activations + streamed, 10_000 * GIB)
    layout = PageLayout(28, tokens // 128, 128, 4, 128, torch.bfloat16, torch.float32, torch.device("cpu"))
    gpu, _ = store_sizes(layout, True, block // 128, depth, gpu_resident_layers=plan.gpu_resident_layers,
                         selection_pages=selection)
    assert 0 < plan.gpu_resident_layers < 28
    assert gpu <= free - activations, (gpu / GIB, (free - activations) / GIB)
    # ...and the streamed room is not double counted: one more layer would not have fit.
    assert gpu + plan.layer_bytes > free - activations


def test_cli_out_of_gpu_memory_is_one_sentence_naming_what_frees_memory(monkeypatch, capsys):
    """A step that runs the GPU out of memory ends membar-train with exit status 4 and one sentence
    (what PyTorch said, then the options that free GPU memory), not a traceback."""
    from membar.oomb import OOMBTrainer

    def step(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total capacity "
                                     "of 139.80 GiB of which 1.62 GiB is free.\nmore lines")

    monkeypatch.setattr(OOMBTrainer, "step", step)
    torch.set_num_threads(1)
    assert main(["--model", "tiny-qwen2", "--seq-len", "1K", "--chunk", "256", "--page-tokens", "64", "--steps", "1",
                 "--no-progress", "--device", "cpu"]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("membar-train: the GPU ran out of memory (CUDA out of memory. Tried")
    assert "--offload" in err[0] and "--grad-dtype bfloat16" in err[0] and "more lines" not in err[0]
