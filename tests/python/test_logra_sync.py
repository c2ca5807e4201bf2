"""Seed-based policy sync: drift, late joiners, overruns and dying subscribers."""
import multiprocessing
import os
import signal
import time
import uuid

import pytest
import torch
import torch.nn as nn

from membar import logra
from membar.logra.sync import PolicyPublisher, PolicySubscriber, SharedMemoryRing, SyncOverrun


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 64), nn.Tanh(), nn.Linear(64, 40), nn.Tanh(), nn.Linear(40, 48)).to(torch.bfloat16)


TARGETS = ("0", "2", "4")


class Trainer:
    """A LoGRA trainer whose sketches are filled with random values (the sync path does not care
    where they came from)."""

    def __init__(self, name, lr=1e-3, slots=64, snapshot_every=16, master_weights=True, stochastic_rounding=True,
                 runtime=None):
        self.model = make_model()
        self.handle = logra.apply_logra(self.model, rank=6, targets=TARGETS, seed=21, master_weights=master_weights)
        self.publisher = PolicyPublisher(name, self.handle, slots=slots, snapshot_every=snapshot_every,
                                         runtime=runtime)
        self.optimizer = logra.LoGRAOptimizer(self.handle, lr=lr, algorithm="adam", publisher=self.publisher,
                                              stochastic_rounding=stochastic_rounding)
        self.generator = torch.Generator().manual_seed(1)

    def update(self, count=1):
        for _ in range(count):
            for layer in self.handle.layers:
                layer.sketch_for_accumulation().copy_(torch.randn(layer.out_features, layer.rank, generator=self.generator))
            self.optimizer.step()

    def masters(self):
        return self.handle.authoritative_weights()

    def close(self):
        self.publisher.close()


def subscriber_weights(model):
    # The receiver's targeted weights by matrix id (apply_logra order of the same model).
    return {index: model[int(name)].weight for index, name in enumerate(TARGETS)}


@pytest.fixture
def channel_name():
    return f"membar_test_{uuid.uuid4().hex[:12]}"


def test_receiver_matches_trainer_after_100_updates_and_bf16_only_receiver_drifts(channel_name):
    # Round-to-nearest messages: a receiver without masters applies them to bf16 as they are.
    trainer = Trainer(channel_name, lr=2e-4, stochastic_rounding=False)
    receiver_model = make_model()
    naive_model = make_model()
    receiver = PolicySubscriber(channel_name, subscriber_weights(receiver_model))
    naive = PolicySubscriber(channel_name, subscriber_weights(naive_model), keep_masters=False)
    try:
        for _ in range(10):
            trainer.update(10)
            receiver.poll()
            naive.poll()
        assert receiver.applied == naive.applied == 100
        for index, name in enumerate(TARGETS):
            master = trainer.masters()[index]
            # Same kernel, same device, same fp32 inputs: the masters agree to the bit, and the
            # rollout's bf16 weights are the trainer's masters rounded once.
            assert torch.equal(receiver.masters[index], master)
            assert torch.equal(receiver_model[int(name)].weight, master.to(torch.bfloat16))
            assert torch.equal(trainer.handle.layers[index].weight, master.to(torch.bfloat16))
        # Without fp32 masters, bf16 swallows the small deltas: the rollout drifts far beyond
        # one bf16 rounding of the trainer's weights.
        drift = max((naive_model[int(name)].weight.float() - trainer.masters()[i]).abs().max().item()
                    for i, name in enumerate(TARGETS))
        rounding = max((trainer.masters()[i].to(torch.bfloat16).float() - trainer.masters()[i]).abs().max().item()
                       for i in range(len(TARGETS)))
        assert drift > 2 * rounding
    finally:
        receiver.close()
        naive.close()
        trainer.close()


def test_bf16_trainer_and_bf16_receiver_stay_bit_identical_with_stochastic_rounding(channel_name):
    # No fp32 copies anywhere: both sides round the same updates with the same random bits.
    trainer = Trainer(channel_name, lr=2e-4, master_weights=False, stochastic_rounding=True)
    initial = [w.clone() for w in trainer.masters()]
    receiver_model = make_model()
    receiver = PolicySubscriber(channel_name, subscriber_weights(receiver_model), keep_masters=False)
    try:
        trainer.update(100)
        receiver.poll()
        assert receiver.applied == 100
        for index, name in enumerate(TARGETS):
            assert trainer.masters()[index].dtype == torch.bfloat16
            assert torch.equal(receiver_model[int(name)].weight, trainer.masters()[index])
        # The updates (about 2e-4 per entry, below half a bf16 ulp of most weights) still moved
        # the weights: round-to-nearest would have left most of them untouched.
        changed = sum((w != w0).float().mean().item() for w, w0 in zip(trainer.masters(), initial)) / len(initial)
        assert changed > 0.5
    finally:
        receiver.close()
        trainer.close()


def test_stochastic_rounding_is_unbiased_and_deterministic():
    key = logra.ProjectionKey(1, 0, 0)
    update = torch.full((64, 4), 2e-4)  # each step moves an entry by about 4e-4 (|U A| ~ 2e-4 * 2)
    exact = torch.ones(64, 256)
    rounded = torch.ones(64, 256, dtype=torch.bfloat16)
    nearest = torch.ones(64, 256, dtype=torch.bfloat16)
    for update_index in range(40):
        seed = logra.ops.rounding_seed_for(7, update_index)
        logra.fused_update_(exact, update, 1.0, key)
        logra.fused_update_(rounded, update, 1.0, key, seed)
        logra.fused_update_(nearest, update, 1.0, key)
    assert torch.all(nearest == 1.0)  # every change was below half an ulp of 1.0 (2^-8)
    error = (rounded.float() - exact).mean().abs().item()
    movement = (exact - 1.0).abs().mean().item()
    assert movement > 5e-3 and error < 0.05 * movement
    again = torch.ones(64, 256, dtype=torch.bfloat16)
    for update_index in range(40):
        logra.fused_update_(again, update, 1.0, key, logra.ops.rounding_seed_for(7, update_index))
    assert torch.equal(again, rounded)


def test_late_joiner_reanchors_from_snapshot(channel_name):
    trainer = Trainer(channel_name, snapshot_every=16)
    try:
        trainer.update(40)
        late_model = make_model(seed=99)  # deliberately different initial weights
        late = PolicySubscriber(channel_name, subscriber_weights(late_model), join="snapshot")
        assert late.applied == 32 and late.reanchors == 1
        late.poll()
        assert late.applied == 40
        for index in range(len(TARGETS)):
            assert torch.equal(late.masters[index], trainer.masters()[index])
        late.close()
    finally:
        trainer.close()


def test_reader_that_falls_a_ring_behind_reanchors(channel_name):
    trainer = Trainer(channel_name, slots=8, snapshot_every=4)
    receiver = PolicySubscriber(channel_name, subscriber_weights(make_model()))
    try:
        trainer.update(3)
        receiver.poll()
        trainer.update(20)  # the ring holds 8: message 3 is gone
        with pytest.raises(SyncOverrun):
            receiver.ring.read_message(3)
        receiver.poll()
        assert receiver.applied == 23 and receiver.reanchors == 1
        for index in range(len(TARGETS)):
            assert torch.equal(receiver.masters[index], trainer.masters()[index])
    finally:
        receiver.close()
        trainer.close()


def _subscriber_process(name, updates, result_queue, announce_queue):
    model = make_model()
    subscriber = PolicySubscriber(name, subscriber_weights(model))
    announce_queue.put(os.getpid())
    ok = subscriber.wait_for(updates, timeout_s=120)
    # numpy, not torch: torch shares tensors through file descriptors that die with this process.
    result_queue.put((ok, [subscriber.masters[i].numpy().copy() for i in range(len(TARGETS))]))
    subscriber.close()


def test_dying_subscriber_does_not_disturb_trainer_and_another_process_stays_in_sync(channel_name):
    trainer = Trainer(channel_name)
    context = multiprocessing.get_context("spawn")
    results, announce, unused_results = context.Queue(), context.Queue(), context.Queue()
    survivor = context.Process(target=_subscriber_process, args=(channel_name, 60, results, announce))
    victim = context.Process(target=_subscriber_process, args=(channel_name, 10**6, unused_results, announce))
    survivor.start()
    victim.start()
    try:
        announce.get(timeout=120)
        announce.get(timeout=120)
        trainer.update(20)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=30)
        started = time.monotonic()
        trainer.update(40)  # never waits on anyone
        assert time.monotonic() - started < 60
        ok, masters = results.get(timeout=120)
        assert ok
        for index in range(len(TARGETS)):
            assert torch.equal(torch.from_numpy(masters[index]), trainer.masters()[index])
        survivor.join(timeout=30)
    finally:
        for process in (survivor, victim):
            if process.is_alive():
                process.kill()
        trainer.close()


def test_transport_rejects_bad_use(channel_name):
    with pytest.raises(FileNotFoundError, match="no LoGRA policy channel"):
        SharedMemoryRing(channel_name, create=False)
    ring = SharedMemoryRing(channel_name, create=True, slot_count=4, slot_bytes=16, snapshot_bytes=16)
    try:
        with pytest.raises(ValueError, match="does not fit"):
            ring.write_message(b"x" * 17)
        assert ring.read_message(0) is None
        assert ring.read_snapshot() is None
        ring.write_message(b"hello")
        assert ring.read_message(0) == b"hello"
        ring.write_snapshot(1, b"snap")
        assert ring.read_snapshot() == (1, b"snap")
    finally:
        ring.close()
    with pytest.raises(ValueError, match="at least 2 slots"):
        SharedMemoryRing(channel_name, create=True, slot_count=1, slot_bytes=8)


def test_payload_is_much_smaller_than_full_weights(channel_name):
    trainer = Trainer(channel_name)
    try:
        assert trainer.publisher.payload_bytes < 0.5 * trainer.publisher.full_weight_bytes
    finally:
        trainer.close()
