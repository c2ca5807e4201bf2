"""What a newcomer meets first (issue 16, item 4): every mistake ends in one sentence and exit
status 2, nothing claims success it did not have, and logs stay readable."""
from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import numpy
import pytest
import torch

from membar.train import main

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny-qwen2", "--seq-len", "128", "--chunk", "64", "--page-tokens", "32"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def refused(argv, capsys) -> str:
    """Runs membar-train in-process; asserts exit status 2 without a traceback; returns stderr."""
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("membar-train: ") and "Traceback" not in error
    return error


def test_save_to_an_existing_file_is_refused_before_training(tmp_path, capsys):
    target = tmp_path / "model.bin"
    target.write_text("not a directory")
    error = refused([*TINY, "--steps", "1", "--save", str(target)], capsys)
    assert "is an existing file" in error
    assert "step 1" not in capsys.readouterr().out
    assert target.read_text() == "not a directory"


def test_save_writes_the_model_and_the_checkpoints_tokenizer(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from membar.oomb.presets import build_model

    checkpoint = tmp_path / "checkpoint"
    build_model("tiny-qwen2").save_pretrained(checkpoint)
    core = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0").save_pretrained(checkpoint)
    out = tmp_path / "trained"
    assert main(["--model", str(checkpoint), "--seq-len", "128", "--chunk", "64", "--page-tokens", "32",
                 "--steps", "1", "--no-progress", "--save", str(out)]) == 0
    assert "saved the model and its tokenizer" in capsys.readouterr().out
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 512
    assert (out / "tokenizer.json").exists()
    text = "w5 w7 w300"
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == AutoTokenizer.from_pretrained(checkpoint)(text)["input_ids"]


def test_a_model_too_large_for_memory_is_refused_before_it_is_built(capsys):
    # Weights, gradients and AdamW's moments of 7.6B float32 parameters: ~113 GiB, more than any
    # machine this runs on has free; without the estimate the run allocates until it is killed.
    error = refused(["--model", "qwen2.5-7b", "--device", "cpu", "--steps", "1"], capsys)
    assert "needs at least" in error and "choose a smaller model" in error


def test_a_damaged_npy_file_gets_no_unsafe_advice(tmp_path, capsys):
    (tmp_path / "garbage.npy").write_bytes(b"this is not numpy" * 10)
    error = refused([*TINY, "--steps", "1", "--data", str(tmp_path / "garbage.npy")], capsys)
    assert "not a .npy array file" in error and "pickle" not in error
    numpy.save(tmp_path / "cut.npy", numpy.arange(1000, dtype=numpy.int64))
    data = (tmp_path / "cut.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(data[:-100])
    error = refused([*TINY, "--steps", "1", "--data", str(tmp_path / "cut.npy")], capsys)
    assert "damaged .npy" in error and "pickle" not in error


@pytest.mark.parametrize("flag, value, words", [
    ("--batch", "0", "--batch must be at least 1"),
    ("--steps", "0", "--steps must be at least 1"),
    ("--chunk", "0", "--chunk must be at least 1"),
    ("--lr", "0", "--lr must be positive"),
])
def test_impossible_numbers_name_the_argument(flag, value, words, capsys):
    error = refused([*TINY, "--steps", "1", flag, value], capsys)
    assert words in error and "label" not in error


def test_a_broken_checkpoint_is_a_sentence_not_a_traceback(tmp_path, capsys):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert "not a valid JSON file" in refused(["--model", str(tmp_path / "broken"), "--steps", "1"], capsys)


def _run_cli(args, stderr_tty: bool) -> tuple[str, str]:
    environment = dict(os.environ, PYTHONPATH=str(REPO / "bindings" / "python"), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "membar.train", *TINY, *args]
    if not stderr_tty:
        finished = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
        assert finished.returncode == 0, finished.stderr[-2000:]
        return finished.stdout, finished.stderr
    master, slave = pty.openpty()
    # A terminal of 120 columns (a fresh pty has none, and a bar fitted to 0 columns shows nothing).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=slave, env=environment)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 300)
        if not ready:
            break
        try:
            chunk = os.read(master, 4096)
        except OSError:   # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    stdout = process.stdout.read().decode()
    assert process.wait(timeout=60) == 0
    os.close(master)
    return stdout, b"".join(chunks).decode(errors="replace")


def test_progress_is_plain_lines_in_a_log_and_a_labelled_bar_on_a_terminal():
    stdout, stderr = _run_cli(["--steps", "3"], stderr_tty=False)
    assert "\r" not in stdout + stderr, "progress-bar redraws in a log"
    assert sum(line.startswith("step ") for line in stdout.splitlines()) == 3
    _, terminal = _run_cli(["--steps", "3"], stderr_tty=True)
    assert "mean loss (last 3)" in terminal


def test_logra_sgd_momentum_that_a_redraw_would_erase_is_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from membar import logra

    def trained_weights(momentum, redraw_every):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=1, intermediate_size=48, vocab_size=40))
        handle = logra.apply_logra(model, rank=4, seed=1)
        optimizer = logra.LoGRAOptimizer(handle, lr=0.05, algorithm="sgd", momentum=momentum,
                                         redraw_every=redraw_every)
        ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(1))
        for _ in range(4):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
        return [w.clone() for w in handle.authoritative_weights()]

    with pytest.raises(ValueError, match="has no effect when A is redrawn after every update"):
        trained_weights(0.9, redraw_every=1)
    # Where momentum survives between redraws it changes the trajectory.
    with_momentum, without = trained_weights(0.9, redraw_every=4), trained_weights(0.0, redraw_every=4)
    assert any(not torch.equal(a, b) for a, b in zip(with_momentum, without))


def test_logra_example_refuses_bad_arguments_with_a_sentence(capsys, load_example):
    example = load_example("logra_rl")
    for argv, words in ((["--group", "1"], "--group must be at least 2"), (["--rank", "0"], "--rank must be at least 1"),
                        (["--kl-delta", "0"], "--kl-delta must be positive")):
        with pytest.raises(SystemExit) as stop:
            example.parse_args(argv)
        assert stop.value.code == 2 and words in capsys.readouterr().err
