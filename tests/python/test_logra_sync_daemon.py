"""Policy sync through a real membard's channels (host backend): a trainer process publishes,
subscriber processes connected to the same daemon follow it; one dies, one joins late."""
import multiprocessing
import os
import signal
import time

import pytest
import torch

from membar.logra.sync import PolicySubscriber, SharedMemoryRing
from membar.runtime import Runtime
from test_logra_sync import TARGETS, Trainer, make_model, subscriber_weights


@pytest.fixture
def daemon_socket(membard):
    return membard()


def _subscriber_process(socket, name, updates, join, result_queue, announce_queue):
    runtime = Runtime.connect(socket=socket, embedded=False, name=f"rollout-{os.getpid()}")
    model = make_model(seed=0 if join == "start" else 99)
    subscriber = PolicySubscriber(name, subscriber_weights(model), join=join, runtime=runtime)
    announce_queue.put((os.getpid(), subscriber.ring.transport))
    ok = subscriber.wait_for(updates, timeout_s=120)
    # numpy, not torch: torch shares tensors through file descriptors that die with this process.
    result_queue.put((ok, subscriber.applied, subscriber.reanchors,
                      [subscriber.masters[i].numpy().copy() for i in range(len(TARGETS))],
                      [model[int(name)].weight.detach().float().numpy().copy() for name in TARGETS]))
    subscriber.close()


def _start(context, *args):
    process = context.Process(target=_subscriber_process, args=args)
    process.start()
    return process


def test_subscriber_processes_follow_the_trainer_through_daemon_channels_and_one_dies(daemon_socket):
    runtime = Runtime.connect(socket=daemon_socket, embedded=False, name="trainer")
    assert runtime.describe().startswith("daemon:")
    trainer = Trainer("logra.pytest", runtime=runtime)
    assert trainer.publisher.ring.transport == "channel"
    context = multiprocessing.get_context("spawn")
    results, announce, unused_results = context.Queue(), context.Queue(), context.Queue()
    survivor = _start(context, daemon_socket, "logra.pytest", 100, "start", results, announce)
    victim = _start(context, daemon_socket, "logra.pytest", 10**6, "start", unused_results, announce)
    try:
        assert {announce.get(timeout=120)[1] for _ in range(2)} == {"channel"}
        trainer.update(30)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=30)
        started = time.monotonic()
        trainer.update(70)  # never waits on anyone
        assert time.monotonic() - started < 60
        ok, applied, reanchors, masters, weights = results.get(timeout=120)
        assert ok and applied == 100 and reanchors == 0
        for index in range(len(TARGETS)):
            # Same kernel, same device type: the rollout's masters equal the trainer's to the bit,
            # and its bf16 weights are those masters rounded once.
            assert torch.equal(torch.from_numpy(masters[index]), trainer.masters()[index])
            assert torch.equal(torch.from_numpy(weights[index]), trainer.masters()[index].to(torch.bfloat16).float())
        survivor.join(timeout=30)
        assert survivor.exitcode == 0
    finally:
        for process in (survivor, victim):
            if process.is_alive():
                process.kill()
        trainer.close()


def test_late_joiner_reanchors_from_the_daemon_snapshot_channel(daemon_socket):
    runtime = Runtime.connect(socket=daemon_socket, embedded=False, name="trainer")
    trainer = Trainer("logra.late", runtime=runtime, snapshot_every=16)
    context = multiprocessing.get_context("spawn")
    results, announce = context.Queue(), context.Queue()
    late = None
    try:
        trainer.update(40)
        late = _start(context, daemon_socket, "logra.late", 60, "snapshot", results, announce)
        announce.get(timeout=120)
        trainer.update(20)
        ok, applied, reanchors, masters, _ = results.get(timeout=120)
        assert ok and applied == 60 and reanchors == 1
        for index in range(len(TARGETS)):
            assert torch.equal(torch.from_numpy(masters[index]), trainer.masters()[index])
        late.join(timeout=30)
        # Readers map the channels read-only: the trainer's memory cannot be written from there.
        reader = SharedMemoryRing("logra.late", create=False, runtime=Runtime.connect(socket=daemon_socket,
                                                                                     embedded=False, name="reader"))
        with pytest.raises(TypeError):
            reader._ring.buf[0:1] = b"x"
        reader.close()
    finally:
        if late is not None and late.is_alive():
            late.kill()
        trainer.close()
    # The channels went with the publisher: nobody can join any more.
    with pytest.raises(FileNotFoundError, match="no LoGRA policy channel"):
        SharedMemoryRing("logra.late", create=False, runtime=runtime)
