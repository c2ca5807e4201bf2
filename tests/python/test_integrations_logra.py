"""membar.integrations.logra: TRL's GRPOTrainer trained through LoGRA. Rewards rise on a
verifiable toy task, the predicted-KL step control runs every update, and a follower fed only
the published (seed, U) messages ends with the trainer's weights bit for bit. The optimizer
adapter keeps a Trainer's learning-rate schedule and checkpoints LoGRA's state."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (tools/setup.sh installs trl; CI has it)")

@pytest.fixture
def example(load_example):
    return load_example("trl_grpo_logra")


@pytest.fixture(autouse=True)
def _keep_threads():
    threads = torch.get_num_threads()   # the example pins CPU threads; leave the session as found
    yield
    torch.set_num_threads(threads)


def test_grpo_rewards_rise_and_the_follower_matches(example, tmp_path):
    summary = example.main(["--task", "seven", "--sft-steps", "0", "--steps", "12", "--prompts", "8", "--group", "8",
                            "--rank", "16", "--out", str(tmp_path)])
    rewards = summary["rewards"]
    assert len(rewards) == 12
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last >= first + 0.05, f"reward did not rise: {rewards}"
    assert all(alpha is not None and 0 < alpha <= 1.0 for alpha in summary["alpha"])
    assert summary["updates_followed"] == 12 and summary["follower_matches_trainer"]
    assert 0 < summary["sync_payload_bytes"] < summary["full_weight_bytes"]
    assert summary["optimizer_state_bytes"] < summary["dense_adam_state_bytes"]


def test_addition_example_runs(example, tmp_path):
    summary = example.main(["--sft-steps", "5", "--steps", "2", "--prompts", "2", "--group", "4", "--rank", "8",
                            "--out", str(tmp_path)])
    assert len(summary["rewards"]) == 2 and summary["follower_matches_trainer"]
    assert (tmp_path / "summary.json").exists()


def test_example_refuses_a_group_of_one_with_a_sentence(example, capsys):
    with pytest.raises(SystemExit) as stop:
        example.main(["--group", "1"])
    assert stop.value.code == 2
    assert "--group must be at least 2" in capsys.readouterr().err


def test_optimizer_follows_the_schedule_and_round_trips_its_state():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from membar.integrations.logra import LoGRATorchOptimizer
    from membar.logra import LoGRAOptimizer, apply_logra

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=48, vocab_size=50))
    handle = apply_logra(model, rank=4, seed=3)
    optimizer = LoGRATorchOptimizer(LoGRAOptimizer(handle, lr=1e-2))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    ids = torch.randint(0, 50, (2, 12))
    seen = []
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        seen.append(optimizer.logra_optimizer.lr)
        schedule.step()
    assert seen == [1e-2, 5e-3, 2.5e-3]
    state = optimizer.state_dict()
    assert state["logra"]["update_index"] == 3 and "second_moment" in state["logra"]["moments"]
    fresh = LoGRATorchOptimizer(LoGRAOptimizer(apply_logra(copy_of(model), rank=4, seed=3), lr=1e-2))
    fresh.load_state_dict(state)
    assert fresh.logra_optimizer.update_index == 3
    assert fresh.logra_optimizer.logra.key_state.step == handle.key_state.step
    assert torch.equal(fresh.logra_optimizer.states.flat("second_moment"), handle.states.flat("second_moment"))


def copy_of(model):
    """A fresh model of the same shape with the LoGRA layers' weights (for the restore check)."""
    from transformers import Qwen2ForCausalLM

    fresh = Qwen2ForCausalLM(model.config)
    fresh.load_state_dict(model.state_dict(), strict=False)
    return fresh
