"""One rank of the data-parallel tests (test_oomb_distributed.py): run as a process of its own with
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. Usage: dist_worker.py CASE OUT_DIR

Rank r trains rows of the global batch from the same generator as the test's reference (gloo,
float32, CPU) and saves what the test compares into OUT_DIR/rank{r}.pt."""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))
from dist_common import TOKENS, global_batch, small_model, split_config, split_model  # noqa: E402

from membar import logra  # noqa: E402
from membar.oomb import OOMBConfig, OOMBTrainer  # noqa: E402

UPDATES = 3


def main() -> None:
    case, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    if case == "fsdp":   # dist_worker.py fsdp OUT DTYPE MASTERS: LoGRA with frozen weights sharded by FSDP2
        sharded_logra(out, rank, world, sys.argv[3], sys.argv[4] == "masters")
        return
    if case == "tensor":   # dist_worker.py tensor OUT T FAMILY: T-way head parallel, world / T data parallel
        tensor_parallel(out, rank, world, int(sys.argv[3]), sys.argv[4], sys.argv[5] if len(sys.argv) > 5 else "dense")
        return
    model = small_model()
    if case not in ("broadcast", "relay"):
        trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=96, page_tokens=32), process_group=dist.group.WORLD)
    result = {}
    if case == "gradients":
        batch = global_batch(world)
        result["loss"] = trainer.step(batch[rank: rank + 1])
        result["reduced_bytes"] = trainer.stats["reduced_bytes"]
        result["overlapped_bytes"] = trainer.stats["overlapped_bytes"]
        result["grads"] = {name: p.grad.clone() for name, p in model.named_parameters()}
    elif case == "accumulate":   # two micro-batches of one sequence per rank, each half of the step
        batch = global_batch(2 * world)
        for micro in range(2):
            trainer.step(batch[micro * world + rank: micro * world + rank + 1], loss_scale=0.5)
        result["grads"] = {name: p.grad.clone() for name, p in model.named_parameters()}
    elif case == "logra":
        handle = logra.apply_logra(model, rank=8, seed=3, runtime=None)
        trainer.reduce_also(lambda: handle.states.flat("sketch") if handle.states.allocated("sketch") else None)
        batch = global_batch(world)
        result["loss"] = trainer.step(batch[rank: rank + 1])
        result["reduced_bytes"] = trainer.stats["reduced_bytes"]
        result["sketches"] = torch.cat([layer.sketch.flatten().clone() for layer in handle.layers])
        before = [layer.weight.clone() for layer in handle.layers]
        logra.LoGRAOptimizer(handle, lr=100.0, algorithm="sgd").step()
        result["updates"] = [layer.weight - weight for layer, weight in zip(handle.layers, before)]
    elif case in ("broadcast", "relay"):   # rank 0 trains with LoGRA and broadcasts; the others follow
        from membar.logra.broadcast import BroadcastPublisher, BroadcastReceiver

        if rank == 0:
            handle = logra.apply_logra(model, rank=8, seed=3, runtime=None)
            publisher = BroadcastPublisher(handle, max_in_flight=2)
            optimizer = logra.LoGRAOptimizer(handle, lr=1e-2, publisher=publisher)
            batch = global_batch(UPDATES)
            for update in range(UPDATES):
                model(batch[update: update + 1], labels=batch[update: update + 1]).loss.backward()
                optimizer.step()
            publisher.close()
            result["weights"] = [w.detach().clone() for w in handle.authoritative_weights()]
            result["payload_bytes"] = publisher.payload_bytes
        else:
            weights = logra.target_weights(model)
            receiver = BroadcastReceiver(weights, rank=8)
            if case == "relay":   # and into this node's ring, for the node's other rollout processes
                from membar.logra.sync import PolicySubscriber

                ring = f"membar-relay-{os.environ['MASTER_PORT']}-{rank}"
                receiver.relay(ring, slots=8, snapshot_every=2)
                early = logra.target_weights(small_model())
                follower = PolicySubscriber(ring, early)
            while receiver.receive() is not None:
                if case == "relay":
                    follower.poll()
            result["applied"] = receiver.applied
            result["weights"] = [weights[i].detach().clone() for i in sorted(weights)]
            if case == "relay":
                late_weights = logra.target_weights(small_model())
                late = PolicySubscriber(ring, late_weights, join="snapshot")
                late.poll()
                result["follower"] = [early[i].detach().clone() for i in sorted(early)]
                result["late"] = [late_weights[i].detach().clone() for i in sorted(late_weights)]
                result["late_reanchors"], result["late_applied"] = late.reanchors, late.applied
                follower.close(), late.close(), receiver.relayed_to.close()
    else:
        raise SystemExit(f"unknown case {case}")
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    leave()


def tensor_parallel(out: str, rank: int, world: int, size: int, family: str, mode: str = "dense") -> None:
    from membar.oomb import tensor_parallel as tp

    model = split_model(family)
    dp_group, tp_group = tp.make_groups(size)
    trainer = OOMBTrainer(model, split_config(mode), process_group=dp_group, tensor_parallel_group=tp_group)
    replicas = world // size
    batch = global_batch(replicas)
    row = rank // size
    result = {"loss": trainer.step(batch[row: row + 1]), "kv_heads": trainer.num_kv_heads,
              "q_rows": getattr(model.model.layers[0].self_attn, "q_proj",
                                getattr(model.model.layers[0].self_attn, "qkv_proj", None)).weight.shape[0],
              "whole_mlps": tp.info(model).whole_mlps, "vocab_split": tp.info(model).vocab_split,
              "embedding_rows": model.get_input_embeddings().weight.shape[0]}
    experts = getattr(model.model.layers[0].mlp, "experts", None)
    if experts is not None:
        result["expert_columns"] = experts.down_proj.shape[2]
    down = getattr(model.model.layers[0].mlp, "down_proj", None)
    if isinstance(getattr(down, "weight", None), torch.Tensor) and down.weight.dim() == 2:
        result["down_columns"] = down.weight.shape[1]
    result["grads"] = tp.full_gradients(model)
    result["norm"] = float(tp.clip_grad_norm_(model, 1e-3))
    result["clipped"] = tp.full_gradients(model)
    result["state"] = tp.full_state_dict(model)
    result["logits"] = trainer.predict(batch[0], [5, TOKENS - 1])
    result["selections"] = {key: (None if value is None else value.cpu())
                            for key, value in trainer.last_selections.items()}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    leave()


def sharded_logra(out: str, rank: int, world: int, dtype: str, masters: bool) -> None:
    from membar.logra.sync import PolicyUpdate, apply_update

    model = small_model().to(getattr(torch, dtype))
    handle = logra.apply_logra(model, rank=8, seed=3, runtime=None, master_weights=masters)
    # A receiver's copy: whole weights (and fp32 masters when the trainer keeps them).
    whole = {layer.matrix_id: layer.weight.detach().clone() for layer in handle.layers}
    whole_masters = {i: w.float() for i, w in whole.items()} if masters else whole
    wrapped = logra.shard_weights(handle)

    class Receiver:   # stands in for a rollout process: applies each published update to whole weights
        snapshot_every = 0

        def publish(self, update_index, seed, step, matrices, stochastic_rounding):
            update = PolicyUpdate(update_index=update_index, seed=seed, step=step, stochastic_rounding=stochastic_rounding,
                                  matrices=[(i, u.clone()) for i, u in matrices])
            apply_update(whole_masters, whole, masters, update)

    optimizer = logra.LoGRAOptimizer(handle, lr=1e-2 if masters else 10.0, algorithm="sgd", publisher=Receiver(),
                                     process_group=torch.distributed.group.WORLD)
    batch = global_batch(world * UPDATES)
    reduced = []
    for update in range(UPDATES):
        rows = batch[update * world + rank: update * world + rank + 1]
        model(rows, labels=rows).loss.backward()
        step = optimizer.step()
        reduced.append((step.reduced_bytes, step.reduce_seconds))
    layer = handle.layers[0]
    result = {"wrapped": wrapped, "reduced": reduced,
              "sketch_bytes": 4 * sum(layer.out_features * layer.rank for layer in handle.layers), "local_rows": layer.weight.to_local().shape[0], "rows": layer.weight.shape[0],
              "weights": [w.clone() for w in logra.full_weights(handle)],
              "receiver": [whole[layer.matrix_id] for layer in handle.layers]}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    leave()


def leave() -> None:
    """Tears the job down and ends the process without the interpreter's finalisation: with FSDP2
    a rank has aborted there in CI ("terminate called without an active exception") after its
    results were written and correct, which would fail the test for a reason of PyTorch's, not
    the code under test."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
