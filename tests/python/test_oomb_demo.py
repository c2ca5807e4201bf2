"""The demo's recall task and a few demo-shaped training steps (CPU, seconds).

The full demo (`make demo`, minutes) is not run here: these tests check that the task puts the key
where the demo says it does, never lets an answer leak into the input, and that OOMB training steps
on it (sparse, balanced batches, as the demo trains) lower the loss on the answers.
"""
import math

import pytest

import torch

from membar.oomb.tasks import RecallTask, passkey_accuracy


def test_recall_task_layout():
    task = RecallTask(vocab_size=64, distance=300, num_keys=8, key_tokens=5, queries=3, seed=0)
    assert task.tokens == 5 + 300 + 3 + 1
    batch = task.batch(8)
    ids, labels = batch.input_ids, batch.labels
    assert ids.shape == labels.shape == (8, task.tokens)
    # Balanced: a batch of num_keys sequences holds every key once.
    assert sorted(batch.keys.tolist()) == list(range(2, 10))
    assert batch.query_positions == [305, 306, 307]
    for row in range(8):
        key = int(batch.keys[row])
        assert (ids[row, :5] == key).all()
        filler = ids[row, 5:305]
        assert (filler >= 10).all() and (filler < 64).all()   # no key, no marker in the filler
        assert (ids[row, 305:] == RecallTask.QUERY_MARKER).all()
        # Position t is trained on labels[t + 1]: every question predicts the key, nothing else is trained.
        trained = (labels[row] != -100).nonzero().flatten().tolist()
        assert trained == [306, 307, 308]
        assert (labels[row, trained] == key).all()
        # The answer is never in the input after the opening, and every question is > distance
        # tokens after the key's last copy.
        assert not (ids[row, 5:] == key).any()
        assert min(batch.query_positions) - 4 > 300
    # Fresh keys from batch to batch; more sequences than keys still cover every key evenly.
    keys = task.batch(16).keys.tolist()
    assert all(keys.count(key) == 2 for key in range(2, 10))


def test_recall_task_with_key_markers_states_the_key_in_pairs():
    task = RecallTask(vocab_size=64, distance=200, num_keys=4, key_tokens=6, queries=2, seed=3, key_marker=True)
    batch = task.batch(4)
    for row in range(4):
        ids = batch.input_ids[row]
        assert (ids[0:6:2] == RecallTask.KEY_MARKER).all()
        assert (ids[1:6:2] == batch.keys[row]).all()
        assert not (ids[6:] == RecallTask.KEY_MARKER).any()
    with pytest.raises(ValueError, match="key_tokens >= 2"):
        RecallTask(vocab_size=64, distance=100, key_tokens=1, key_marker=True)


def test_recall_task_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_keys"):
        RecallTask(vocab_size=64, distance=100, num_keys=1)
    with pytest.raises(ValueError, match="too few filler"):
        RecallTask(vocab_size=16, distance=100, num_keys=8)
    with pytest.raises(ValueError, match=">= 1"):
        RecallTask(vocab_size=64, distance=100, queries=0)


def _demo_shaped_model(vocab_size, seed=0):
    from membar.oomb.presets import PRESETS, preset_config
    from transformers import AutoModelForCausalLM

    assert PRESETS["demo"][1]["tie_word_embeddings"]
    config = preset_config("demo", 1024)
    config.vocab_size = vocab_size
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def test_demo_steps_lower_the_answer_loss():
    from membar.oomb import OOMBConfig, OOMBTrainer

    torch.set_num_threads(1)
    # The demo's shape and optimiser at 1/40 of its length: the key opens 736 tokens, 8 questions.
    model = _demo_shaped_model(vocab_size=256)
    trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=256, page_tokens=64, mode="sparse", top_k=4,
                                            query_tile_tokens=64))
    task = RecallTask(256, distance=640, num_keys=8, key_tokens=64, queries=8, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(40):
        batch = task.batch(4)
        losses.append(trainer.step(batch.input_ids, batch.labels))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    start, end = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert start > math.log(8)          # untrained: worse than guessing among the keys
    assert end < 0.5 * start, (start, end)
    # Held-out sequences: the window without the key falls back to guessing, the whole sequence
    # does better than guessing.
    held_out = [RecallTask(256, distance=640, num_keys=8, key_tokens=64, queries=8, seed=7).batch(1)
                for _ in range(16)]
    whole = passkey_accuracy(trainer, None, 16, batches=held_out)
    window = passkey_accuracy(trainer, None, 16, window=256, batches=held_out)
    assert whole > window, (whole, window)


def test_window_that_misses_the_question_is_rejected():
    from membar.oomb import OOMBConfig, OOMBTrainer

    model = _demo_shaped_model(vocab_size=64)
    trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=64, page_tokens=64))
    batch = RecallTask(64, distance=100, num_keys=8, key_tokens=2, queries=4, seed=0).batch(1)
    with pytest.raises(ValueError, match="does not reach the question"):
        passkey_accuracy(trainer, None, 1, window=3, batches=[batch])


def test_cli_recall_task_reports_whole_and_window_accuracy(capsys):
    from membar.train import run

    summary = run(["--model", "tiny-qwen2", "--task", "recall", "--distance", "150", "--key-tokens", "8",
                   "--queries", "4", "--key-marker", "--num-keys", "4", "--chunk", "64", "--page-tokens", "32",
                   "--steps", "2", "--batch", "2", "--window", "64", "--eval-sequences", "4", "--no-progress"])
    assert summary["seq_len"] == 8 + 150 + 4 + 1
    assert summary["steps_run"] == 2
    assert 0.0 <= summary["accuracy"] <= 1.0 and 0.0 <= summary["window_accuracy"] <= 1.0
    assert summary["chance"] == 0.25
    printed = capsys.readouterr().out
    assert "only the last 64 tokens" in printed
