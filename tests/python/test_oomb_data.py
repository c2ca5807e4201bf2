"""membar-train --data: token files cut into windows, and --save."""
from __future__ import annotations

import numpy
import pytest
import torch

from membar.oomb.data import TokenWindows, load_tokens
from membar.train import main, run


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def test_every_file_type_gives_the_same_ids(tmp_path):
    ids = torch.randint(0, 60000, (3, 1000))
    torch.save(ids, tmp_path / "a.pt")
    torch.save([ids[0], ids[1:]], tmp_path / "list.pt")
    numpy.save(tmp_path / "a.npy", ids.numpy().astype(numpy.int32))
    ids.numpy().astype(numpy.uint16).tofile(tmp_path / "a.bin")
    ids.numpy().astype(numpy.uint32).tofile(tmp_path / "b.bin")
    flat = ids.flatten()
    for path, dtype in (("a.pt", "uint16"), ("list.pt", "uint16"), ("a.npy", "uint16"), ("a.bin", "uint16"),
                        ("b.bin", "uint32")):
        loaded = load_tokens(str(tmp_path / path), dtype)
        assert loaded.dtype == torch.int64 and torch.equal(loaded, flat), path


def test_bad_files_get_a_sentence(tmp_path):
    torch.save(torch.rand(10), tmp_path / "float.pt")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    (tmp_path / "a.csv").write_text("1,2,3")
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(ValueError, match="no such file"):
        load_tokens(str(tmp_path / "missing.npy"))
    with pytest.raises(ValueError, match="must be integers"):
        load_tokens(str(tmp_path / "float.pt"))
    with pytest.raises(ValueError, match="whole number"):
        load_tokens(str(tmp_path / "odd.bin"))
    with pytest.raises(ValueError, match="unknown file type"):
        load_tokens(str(tmp_path / "a.csv"))
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokens(str(tmp_path / "a.txt"), tokenizer_path="tiny-qwen2")
    with pytest.raises(ValueError, match="fewer than one sequence"):
        TokenWindows(torch.arange(10), 64, 100)
    with pytest.raises(ValueError, match=r"\[0, 100\)"):
        TokenWindows(torch.arange(200), 64, 100)


def test_windows_visit_every_sequence_once_per_epoch():
    tokens = torch.arange(1000) % 97
    windows = TokenWindows(tokens, 100, 97, seed=1)
    assert windows.count == 10
    seen = torch.cat([windows.batch(2) for _ in range(5)])
    firsts = sorted(int(row[0]) for row in seen)
    assert firsts == sorted(int(tokens[i * 100]) for i in range(10))   # each window once
    assert windows.epoch == 1
    windows.batch(3)
    assert windows.epoch == 2


def test_cli_learns_from_a_file_and_saves_the_model(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    # A periodic stream: after a few steps the model predicts it far better than chance.
    pattern = torch.randint(0, 512, (23,), generator=torch.Generator().manual_seed(0))
    numpy.save(tmp_path / "tokens.npy", pattern.repeat(200).numpy())
    summary = run(["--model", "tiny-qwen2", "--data", str(tmp_path / "tokens.npy"), "--seq-len", "256",
                   "--chunk", "64", "--page-tokens", "32", "--steps", "12", "--lr", "1e-2", "--batch", "2",
                   "--no-progress", "--save", str(tmp_path / "out")])
    losses = [step["loss"] for step in summary["steps"]]
    assert losses[0] > 5.5 and losses[-1] < 0.7 * losses[0], losses   # measured: 6.2 -> 2.9
    assert "17 sequences of 256" in capsys.readouterr().out
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert summary["saved"] == str(tmp_path / "out") and saved.config.vocab_size == 512


def test_cli_rejects_text_without_a_tokenizer(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text")
    assert main(["--model", "tiny-qwen2", "--data", str(tmp_path / "a.txt"), "--steps", "1", "--no-progress"]) == 2
    assert "tokenizer" in capsys.readouterr().err


def test_learning_experiment_runs_both_arms_for_the_same_steps():
    """membar.oomb.learning (bench --learning, the GPU demo) on the CPU with a tiny budget."""
    from membar.oomb.learning import recall_experiment

    lines = []
    outcome = recall_experiment(3.0, device="cpu", distance=256, chunk=128, eval_sequences=2, eval_seconds=1.0,
                                short_window=128, log=lines.append)
    full, short = outcome["oomb_full_context"], outcome["short_window"]
    assert full["steps"] >= 1 and short["steps"] == full["steps"]
    assert 0.0 <= full["accuracy"] <= 1.0 and outcome["tokens"] == 2048 + 256 + 9
    assert any("held-out accuracy before training" in line for line in lines)


def test_default_device_needs_membar_cuda_kernels(monkeypatch, capsys):
    import membar
    from membar import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(membar, "has_cuda_kernels", lambda: False)
    assert train._device(None).type == "cpu"
    assert "no CUDA kernels" in capsys.readouterr().out
    with pytest.raises(ValueError, match="without CUDA kernels"):
        train._device("cuda")
