"""Chunk-recurrent training of a Hugging Face causal LM (the OOMB method, exact gradients).

Note [Two stages]
  Rationale: full-sequence training keeps activations and the KV of every token at once; memory
  grows with the sequence twice over. Cutting the sequence into chunks and running them one at a
  time keeps activations O(chunk); only the KV (and, in backward, dK/dV) of the whole sequence
  remains, and that lives in pages (kv_store.py) that can be offloaded.
  Approach: stage 1 runs chunks 0..C-1 forward without grad; each layer's attention writes the
  chunk's post-RoPE K/V into its pages and attends to the pages of earlier chunks plus its own
  chunk causally. Stage 2 runs chunks C-1..0: recompute the chunk with grad, compute its loss
  (normalised by the whole batch's count of predicted tokens, so the sum over chunks is the
  full-sequence mean loss), backward. The attention backward adds dK/dV of the history into grad
  pages; when chunk c runs, every later chunk has run, so its own grad pages are complete and are
  added to the autograd gradient of its K/V (hf_attention._InjectPageGrads). Parameters end with
  the .grad that full-sequence training would give, up to floating-point summation order.
  Limitations: one sequence at a time (a batch is a loop over its rows); no padding masks;
  attention dropout must be 0 (stage 2 must recompute stage 1 exactly). Which models train is
  models.py's Note [One integration point].
"""
from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import config as config_module
from .config import OOMBConfig
from .hf_attention import ATTENTION_NAME, NO_MASK, ChunkContext, chunk_context, current_context, register
from . import cudnn_attention, kernels, models, tensor_parallel
from .kv_store import Access, KVStore, PageLayout
from .runtime_store import RuntimeKVStore

IGNORE_INDEX = -100


def host_memory() -> dict:
    """Resident set size of this process now and at its peak, in bytes (Linux /proc)."""
    values = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    name, amount, _ = line.split()
                    values[name[:-1]] = int(amount) * 1024
    except OSError:
        values["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"rss_bytes": values.get("VmRSS", 0), "peak_rss_bytes": values.get("VmHWM", 0)}


def _piece_loss(lm_head, hidden, targets, logit_softcap: float | None = None):
    # hidden [tokens, hidden_size], targets [tokens]: summed cross-entropy in float32. Gemma's
    # final_logit_softcapping (models.final_logit_softcap) maps logits to cap * tanh(logits / cap).
    split = tensor_parallel.split_head_loss(lm_head, hidden, targets, logit_softcap, IGNORE_INDEX)
    if split is not None:   # Note [Vocabulary split]: no vocabulary-wide logits
        return split
    return _logits_loss(lm_head(hidden), targets, logit_softcap)


def _head_in_place(lm_head) -> bool:
    """Whether Note [Head gradient in place] applies: an exact nn.Linear head that trains and whose
    vocabulary is not split over ranks (Note [Vocabulary split])."""
    return (type(lm_head) is torch.nn.Linear and lm_head.weight.requires_grad
            and getattr(lm_head, "_membar_vocab_split", None) is None)


class _HeadLoss(torch.autograd.Function):
    """Note [Head gradient in place]
    Rationale: the output projection's weight is vocabulary x hidden (152064 x 3584 at 7B: 1.04 GiB
    in bf16). Through autograd each loss piece's backward makes a new gradient of that size, summed
    with the other pieces' in a buffer and then into .grad: one to two GiB held beside the step's
    peak, whatever the piece size (the GPU peak at 32K with offload stayed 34.2 GiB for pieces of
    1024 and 512 tokens).
    Approach: the piece's loss as one function that keeps only its inputs (no logits), whose
    backward recomputes the piece's logits (as the activation checkpoint of the plain path does) and
    adds dlogitsᵀ·hidden into the weight's existing .grad with addmm_ (one rounding, not two).
    Where the weight has no .grad yet, or has hooks that must see its gradient arrive (data parallel
    reductions: register_post_accumulate_grad_hook), the gradient is returned to autograd as usual.
    Limitations: exact nn.Linear heads only (others, and split vocabularies, take the plain path).
    The memory it saves has not been measured on a GPU yet."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, logit_softcap):
        ctx.save_for_backward(hidden, weight, bias, targets)
        # The parameter itself, for its .grad: a saved tensor may come back as another object (under
        # the loss's activation checkpointing it is recomputed).
        ctx.parameter = weight
        ctx.logit_softcap = logit_softcap
        with torch.no_grad():
            return _logits_loss(F.linear(hidden, weight, bias), targets, logit_softcap)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, targets = ctx.saved_tensors
        with torch.enable_grad():
            logits = F.linear(hidden, weight, bias).detach().requires_grad_()
            loss = _logits_loss(logits, targets, ctx.logit_softcap)
            (grad_logits,) = torch.autograd.grad(loss, logits, grad_loss)
        grad_hidden = grad_logits @ weight if ctx.needs_input_grad[0] else None
        grad_bias = grad_logits.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            parameter = ctx.parameter
            if parameter.grad is not None and not getattr(parameter, "_post_accumulate_grad_hooks", None):
                parameter.grad.addmm_(grad_logits.t(), hidden)
            else:
                grad_weight = grad_logits.t() @ hidden
        return grad_hidden, grad_weight, grad_bias, None, None


def _logits_loss(logits, targets, logit_softcap):
    # logits in the weight's dtype, as the head gives them; the summed loss in float32.
    logits = logits.float()
    if logit_softcap is not None:
        logits = torch.tanh(logits / logit_softcap) * logit_softcap
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


class OOMBTrainer:
    """Computes full-sequence gradients of a causal LM chunk by chunk.

    trainer = OOMBTrainer(model, OOMBConfig(chunk_tokens=4096, mode="dense", offload=True))
    loss = trainer.step(input_ids)      # fills .grad like loss.backward() on the full sequence
    optimizer.step(); optimizer.zero_grad()
    trainer.stats                       # tokens/s, peak memory, pages moved of the last step

    Pages live in membar's memory runtime (runtime_store.py, Note [Runtime pages]): the runtime
    given, else the membard daemon at `socket` (default $MEMBAR_SOCKET), else one embedded in this
    process; with config.offload they live in host memory and stream through a GPU budget. `store`
    replaces it with another KVStore. step() blocks until the step's GPU work is done.

    Several processes (torch.distributed): process_group makes the step data parallel (Note [Data
    parallel steps] in distributed.py); tensor_parallel_group splits the model's heads, pages and
    MLPs over that group (Note [Head parallel layers] in tensor_parallel.py; the model is split in
    place when the trainer is made). Both may be given.
    """

    def __init__(self, model, config: OOMBConfig | None = None, store: KVStore | None = None, *,
                 runtime=None, socket: str | None = None, name: str = "membar-trainer", process_group=None,
                 tensor_parallel_group=None, **options):
        if config is None:
            config = OOMBConfig(**options)
        elif options:
            config = replace(config, **options)
        models.check_model(model)
        register()
        try:
            model.set_attn_implementation(ATTENTION_NAME)
        except (ValueError, KeyError, AttributeError):
            model.config._attn_implementation = ATTENTION_NAME
        if model.config._attn_implementation != ATTENTION_NAME:
            raise ValueError("could not switch the model's attention to membar's paged attention.")
        # Head parallel (Note [Head parallel layers] in tensor_parallel.py): split the model's heads
        # and MLPs over the group before the probe, so that everything after sees this rank's part.
        self.tensor_parallel_group = tensor_parallel_group
        self.tensor_parallel = 1
        if tensor_parallel_group is not None:
            from . import tensor_parallel

            self.tensor_parallel = tensor_parallel.shard_model(model, tensor_parallel_group).size
        if config.checkpoint_layers:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = model
        self.config = config
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        text_config = models.text_config(model.config)
        self.num_layers = text_config.num_hidden_layers
        self.vocab_size = text_config.vocab_size
        # What each layer hands the attention interface (Note [One integration point] in models.py).
        self.layers = models.probe_layers(self.decoder, self.num_layers, self.device)
        models.check_layers(self.layers, config.mode)
        self.num_q_heads = self.layers[0].num_q_heads
        self.num_kv_heads, self.head_dim = self.layers[0].num_kv_heads, self.layers[0].head_dim
        self.logit_softcap = models.final_logit_softcap(model)
        self.rotary = models.SequenceLengthRotary(
            model, lambda: getattr(current_context(), "sequence_tokens", None))
        self.store = store if store is not None else RuntimeKVStore(
            self.device, offload=config.offload, socket=socket, runtime=runtime,
            gpu_budget_bytes=config.gpu_budget_bytes, gpu_resident_layers=config.gpu_resident_layers,
            name=name)
        self.store.use_config(config)
        self.stats: dict = {}
        # Data parallel (Note [Data parallel steps] in distributed.py): None, or the group whose
        # ranks each train their own sequences; None is a single process.
        self.process_group = process_group
        self._reduced_buffers: list = []
        self._before_last_backward = None
        if process_group is not None:
            from . import distributed

            self.rank, self.world_size = distributed.world(process_group)
        else:
            self.rank, self.world_size = 0, 1
        # Sparse mode: the pages each (layer, chunk) attended in the last sequence, int32
        # [query_tiles, top_k] or None for "all history" (kept for inspection and tests).
        self.last_selections: dict = {}

    # -- public ---------------------------------------------------------------------------------

    def reduce_also(self, buffer) -> None:
        """With a process group: also sum, each step, what this step added to the tensor that
        `buffer()` returns (e.g. LoGRA's flat sketch buffer, whose storage may move between steps)."""
        self._reduced_buffers.append(buffer)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
             stage2_chunks: int | None = None, loss_scale: float = 1.0) -> float:
        """Forward + backward of a batch of sequences; returns the mean loss over predicted tokens.

        input_ids: int [tokens] or [batch, tokens]. labels: same shape, Hugging Face convention
        (aligned with input_ids, shifted inside: position t is trained to predict labels[t + 1];
        IGNORE_INDEX = -100 skips a target); default input_ids. Gradients ACCUMULATE into .grad.
        loss_scale: the gradients and the returned loss are those of loss_scale times the mean loss
        (gradient accumulation's share of a micro-batch, as Hugging Face's Trainer weighs it).

        stage2_chunks (measurement only, Note [Partial steps]): run all of stage 1 but only the
        first this-many chunks of stage 2 (the last chunks of the sequence, whose histories are
        longest), timing every chunk; stats then holds an estimate of the whole step. The .grad
        left behind is NOT the sequence's gradient.
        """
        if stage2_chunks is not None and stage2_chunks < 1:
            raise ValueError(f"stage2_chunks must be >= 1 (or None for a whole step), got {stage2_chunks}.")
        input_ids, labels = self._check_inputs(input_ids, labels)
        predicted = int((labels[:, 1:] != IGNORE_INDEX).sum())   # host tensors: no wait for the GPU
        if self.process_group is None:
            if predicted == 0:
                raise ValueError("no token has a target: every label after the first is -100.")
            return self._split_step(input_ids, labels, predicted, predicted, stage2_chunks, loss_scale)
        from . import distributed

        # Every rank weighs its tokens by the global count (Note [Data parallel steps]).
        global_predicted = distributed.all_sum_int(predicted, self.process_group)
        if global_predicted == 0:
            raise ValueError("no token has a target on any rank: every label after the first is -100.")
        with distributed.StepReduction(self.process_group, self.model.parameters(), self._reduced_buffers) as reduction:
            # Note [Overlapped reduction]: sums start during the step's last backward; gradients
            # that head parallel still sums afterwards wait for finish().
            partial = self._split_partial()
            self._before_last_backward = lambda: reduction.arm(exclude=partial)
            try:
                total = self._split_step(input_ids, labels, predicted, global_predicted, stage2_chunks, loss_scale)
            finally:
                self._before_last_backward = None
            started = time.perf_counter()
            reduced_bytes = reduction.finish()
            sums = torch.tensor([total, float(input_ids.numel())], dtype=torch.float64,
                                device=distributed._reduce_device(self.process_group))
            torch.distributed.all_reduce(sums, group=self.process_group)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            reduce_seconds = time.perf_counter() - started
        loss, global_tokens = (float(value) for value in sums.tolist())
        self.stats.update({"loss": loss, "local_loss": total, "world_size": self.world_size,
                           "global_tokens": int(global_tokens), "global_predicted_tokens": global_predicted,
                           "reduce_seconds": reduce_seconds, "reduced_bytes": reduced_bytes,
                           "overlapped_bytes": reduction.overlapped_bytes})
        self.stats["seconds"] += reduce_seconds
        self.stats["tokens_per_second"] = self.stats["tokens"] / self.stats["seconds"]
        self.stats["global_tokens_per_second"] = global_tokens / self.stats["seconds"]
        return loss

    def _split_step(self, input_ids, labels, predicted: int, weight_count: int, stage2_chunks,
                    loss_scale: float) -> float:
        """_step, then (head parallel) the sum over the tensor-parallel group of the gradients that
        unsplit parameters inside split blocks got from this rank's heads alone."""
        if self.tensor_parallel_group is None:
            return self._step(input_ids, labels, predicted, weight_count, stage2_chunks, loss_scale)
        from . import distributed

        partial = self._split_partial()
        with distributed.StepReduction(self.tensor_parallel_group, partial, []) as reduction:
            total = self._step(input_ids, labels, predicted, weight_count, stage2_chunks, loss_scale)
            started = time.perf_counter()
            reduction.finish()
            seconds = time.perf_counter() - started
        self.stats["seconds"] += seconds
        self.stats["tokens_per_second"] = self.stats["tokens"] / self.stats["seconds"]
        self.stats["tensor_parallel"] = self.tensor_parallel
        return total

    def _split_partial(self) -> list:
        """Head parallel: unsplit parameters whose gradients are summed over the tensor-parallel group."""
        if self.tensor_parallel_group is None:
            return []
        from . import tensor_parallel

        return tensor_parallel.info(self.model).partial

    def _step(self, input_ids, labels, predicted: int, weight_count: int, stage2_chunks, loss_scale: float) -> float:
        """One process's part of step(): gradients of loss_scale * (sum of token losses) / weight_count."""
        store_before = self.store.stats.as_dict()
        cudnn_before = cudnn_attention.calls["forward"] + cudnn_attention.calls["backward"]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        timings = {"stage1_seconds": 0.0, "stage2_seconds": 0.0}
        if stage2_chunks is not None:
            timings["chunk_seconds"] = {"stage1": [], "stage2": [], "stage2_limit": stage2_chunks}
        total = torch.zeros((), dtype=torch.float64, device=self.device)   # summed on the device
        rows = input_ids.shape[0]
        for row in range(rows):
            self._sequence(input_ids[row], labels[row], loss_scale / weight_count, timings, total,
                           last_sequence=row == rows - 1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # The one read of a GPU value in a step (a meta device, used to count memory, has none).
        total = float(total) if self.device.type != "meta" else float("nan")
        seconds = time.perf_counter() - start
        store_after = self.store.stats.as_dict()
        tokens = input_ids.numel()
        self.stats = {
            "loss": total, "tokens": tokens, "predicted_tokens": predicted, "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            **timings,
            "chunks": -(-input_ids.shape[1] // self.config.chunk_tokens),
            "pages_to_device": store_after["pages_to_device"] - store_before["pages_to_device"],
            "pages_to_host": store_after["pages_to_host"] - store_before["pages_to_host"],
            "bytes_moved": (store_after["bytes_to_device"] + store_after["bytes_to_host"]
                            - store_before["bytes_to_device"] - store_before["bytes_to_host"]),
            "pages_read": store_after["pages_read"] - store_before["pages_read"],
            "prefetch_hits": store_after["prefetch_hits"] - store_before["prefetch_hits"],
            "prefetch_misses": store_after["prefetch_misses"] - store_before["prefetch_misses"],
            "predicted_frames": store_after["predicted_frames"] - store_before["predicted_frames"],
            "host_pool_bytes": store_after["host_pool_bytes"],
            "device_pool_bytes": store_after["device_pool_bytes"],
            "stall_seconds": (store_after["stall_ns"] - store_before["stall_ns"]) * 1e-9,
            "store_host_seconds": (store_after["host_ns"] - store_before["host_ns"]) * 1e-9,
            "gpu_maps": store_after["gpu_maps"] - store_before["gpu_maps"],
            "fence_waits": store_after["fence_waits"] - store_before["fence_waits"],
            "store_fence_wait_seconds": (store_after["fence_wait_ns"] - store_before["fence_wait_ns"]) * 1e-9,
            "store_call_seconds": {part: (store_after["call_ns"][part] - store_before["call_ns"][part]) * 1e-9
                                   for part in store_after["call_ns"]},
            "store_map_apply_seconds": (store_after.get("map_apply_ns", 0) - store_before.get("map_apply_ns", 0)) * 1e-9,
            "store_map_wait_seconds": (store_after.get("map_wait_ns", 0) - store_before.get("map_wait_ns", 0)) * 1e-9,
            "map_runs": store_after.get("map_runs", 0) - store_before.get("map_runs", 0),
            "async_maps": bool(store_after.get("async_maps", False)),
            **({"stream_wait_seconds": (store_after["stream_wait_ns"] - store_before["stream_wait_ns"]) * 1e-9,
                "stream_wait_by_kind": _waits_by_kind(store_before.get("stream_wait_by_kind", {}),
                                                      store_after.get("stream_wait_by_kind", {}))}
               if store_after.get("stream_wait_ns", -1) >= 0 else {}),
            **host_memory(),
        }
        self.stats["pages_moved"] = self.stats["pages_to_device"] + self.stats["pages_to_host"]
        if stage2_chunks is not None:
            self.stats.update(_partial_step_estimate(timings["chunk_seconds"], self.stats["stage1_seconds"]))
        # Which kernels ran the dense attention (Note [cuDNN for dense history]).
        self.stats["cudnn_attention_calls"] = (cudnn_attention.calls["forward"] + cudnn_attention.calls["backward"]
                                               - cudnn_before)
        if self.device.type == "cuda":
            # PyTorch's allocations at their peak, plus the runtime's GPU frames (its own pool).
            self.stats["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(self.device)
            self.stats["peak_gpu_bytes_total"] = self.stats["peak_gpu_bytes"] + store_after["device_pool_bytes"]
        return total

    @torch.no_grad()
    def predict(self, input_ids: torch.Tensor, positions) -> torch.Tensor:
        """Next-token logits [len(positions), vocab] at the given positions of one sequence, computed
        chunk by chunk (stage 1 only), so it runs at lengths full attention could not hold."""
        input_ids, _ = self._check_inputs(input_ids, None)
        if input_ids.shape[0] != 1:
            raise ValueError("predict takes one sequence.")
        input_ids = input_ids[0]
        tokens = input_ids.shape[0]
        positions = [int(p) for p in positions]
        if any(p < 0 or p >= tokens for p in positions):
            raise ValueError(f"positions must lie in [0, {tokens}).")
        chunks = self._chunks(tokens)
        shared = {"summaries": {}, "selections": {}}
        logits = [None] * len(positions)
        self.rotary.reset(self.device)
        self.store.open_sequence(self._layout(tokens))
        try:
            self.store.plan(self._stage1_plan(chunks, shared))
            for chunk, (first, end) in enumerate(chunks):
                with chunk_context(self._context(1, chunk, chunks, shared)):
                    hidden = self._run_decoder(input_ids[first:end], first)
                for slot, position in enumerate(positions):
                    if first <= position < end:
                        logits[slot] = self.lm_head(hidden[position - first]).float()
                        if self.logit_softcap is not None:
                            logits[slot] = torch.tanh(logits[slot] / self.logit_softcap) * self.logit_softcap
                if end > max(positions):
                    break
        finally:
            self.store.close_sequence()
        return torch.stack(logits)

    # -- internals ------------------------------------------------------------------------------

    def _check_inputs(self, input_ids, labels):
        """Validated (input_ids, labels) [batch, tokens] int64 on the host (pinned with CUDA): per
        sequence data stays there and each chunk's slice is copied to the device when it runs."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}.")
        if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}.")
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [tokens] or [batch, tokens], got shape {tuple(input_ids.shape)}.")
        if input_ids.shape[1] < 2:
            raise ValueError(f"a sequence needs at least 2 tokens to have a target, got {input_ids.shape[1]}.")
        input_ids = self._to_host(input_ids)
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got range "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}].")
        if labels is None:
            labels = input_ids
        else:
            if not isinstance(labels, torch.Tensor) or labels.is_floating_point():
                raise TypeError("labels must be an integer torch.Tensor shaped like input_ids.")
            if labels.dim() == 1:
                labels = labels.unsqueeze(0)
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} differs from input_ids shape "
                                 f"{tuple(input_ids.shape)}.")
            labels = self._to_host(labels)
            bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= self.vocab_size))
            if bool(bad.any()):
                raise ValueError(f"labels must be -100 or lie in [0, {self.vocab_size}).")
        return input_ids, labels

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to("cpu", torch.long)
        if self.device.type == "cuda" and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host slice on the compute device, copied without blocking the host."""
        return kernels.to_device(tensor.contiguous(), self.device)

    def reserve(self, tokens: int) -> None:
        """Allocates the page pools for sequences of up to `tokens` tokens now, so that no step
        pays for it (pinned host memory takes ~40 ms per GiB to allocate)."""
        self.store.reserve(self._layout(tokens))

    def _layout(self, tokens: int) -> PageLayout:
        return PageLayout(self.num_layers, -(-tokens // self.config.page_tokens), self.config.page_tokens,
                          self.num_kv_heads, self.head_dim, self.dtype, self.config.grad_page_dtype,
                          self.device)

    def _chunks(self, tokens: int) -> list[tuple[int, int]]:
        size = self.config.chunk_tokens
        return [(first, min(first + size, tokens)) for first in range(0, tokens, size)]

    def _context(self, stage: int, chunk: int, chunks: list[tuple[int, int]], shared: dict) -> ChunkContext:
        first, end = chunks[chunk]
        return ChunkContext(
            store=self.store, config=self.config, layers=self.layers, stage=stage, chunk=chunk, first_token=first,
            chunk_tokens=end - first, sequence_tokens=chunks[-1][1],
            summaries=shared["summaries"], selections=shared["selections"],
            selection_unions=shared.setdefault("unions", {}), stage1_outputs=shared.get("stage1_outputs"),
            split_group=self.tensor_parallel_group)

    def _stage1_plan(self, chunks, shared) -> list[Access]:
        plan = []
        for chunk in range(len(chunks)):
            context = self._context(1, chunk, chunks, shared)
            selecting = context.history_pages > self.config.top_k
            for layer in range(self.num_layers):
                if selecting and context.sparse(layer):
                    continue   # the pages are chosen only when the chunk's queries exist
                plan += context.history_accesses(layer, "stage1")
        return plan

    def _stage2_plan(self, chunks, shared) -> list[Access]:
        """Every page access of stage 2 in order: per chunk (last first) the forward's history of
        every layer, then per layer (last first) the backward's history and grad pages (block by
        block when streamed) and the chunk's own grad pages. Layer recomputes of checkpointing
        reuse the forward's attention output and access nothing."""
        plan = []
        for chunk in reversed(range(len(chunks))):
            context = self._context(2, chunk, chunks, shared)
            for layer in range(self.num_layers):
                if not self.config.reuse_stage1_attention:   # Note [Stage 1's attention in stage 2]
                    plan += context.history_accesses(layer, "forward")
            for layer in reversed(range(self.num_layers)):
                for access, grad_access in zip(context.history_accesses(layer, "backward"),
                                               context.history_accesses(layer, "backward", kind="dkv")):
                    plan += [access, grad_access]
                if context.later_chunks:
                    plan.append(context.own_grad_access(layer))
        return plan

    def _run_decoder(self, chunk_ids: torch.Tensor, first: int) -> torch.Tensor:
        """chunk_ids: int64 [tokens] on the host; returns the last hidden states [tokens, hidden]."""
        positions = torch.arange(first, first + chunk_ids.shape[0], device=self.device).unsqueeze(0)
        output = self.decoder(input_ids=self._on_device(chunk_ids).unsqueeze(0), position_ids=positions,
                              attention_mask=NO_MASK, use_cache=False)
        return output.last_hidden_state[0]   # [tokens, hidden_size]

    def _chunk_loss(self, hidden: torch.Tensor, targets: torch.Tensor):
        """Summed cross-entropy of a chunk, computed piece by piece; None when nothing is predicted.
        targets: int64 [tokens] on the host (which pieces predict nothing is known without the GPU)."""
        total = None
        piece = self.config.loss_piece_tokens
        for start in range(0, targets.shape[0], piece):
            piece_targets = targets[start: start + piece]
            if not bool((piece_targets != IGNORE_INDEX).any()):
                continue
            if _head_in_place(self.lm_head):   # Note [Head gradient in place]: it recomputes itself
                part = _HeadLoss.apply(hidden[start: start + piece], self.lm_head.weight, self.lm_head.bias,
                                       self._on_device(piece_targets), self.logit_softcap)
            else:
                part = checkpoint(_piece_loss, self.lm_head, hidden[start: start + piece],
                                  self._on_device(piece_targets), self.logit_softcap, use_reentrant=False)
            total = part if total is None else total + part
        return total

    def stage1_output_bytes(self, tokens: int) -> int:
        """What reuse_stage1_attention holds between the stages for a sequence of this many tokens:
        every layer's attention output (model dtype) and log-sum-exp (float32) of every token."""
        return tokens * sum(layer.num_q_heads * (layer.head_dim * self.dtype.itemsize + 4) for layer in self.layers)

    def _check_stage1_output_room(self, tokens: int) -> None:
        """A sentence, before any work, where stage 1's kept attention outputs cannot fit (Note
        [Stage 1's attention in stage 2] in hf_attention.py): the GPU's free memory, or host memory
        with offload (or on a CPU)."""
        need = self.stage1_output_bytes(tokens)
        if self.device.type == "cuda" and not self.config.offload:
            free, _ = torch.cuda.mem_get_info(self.device)
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            where = "the GPU has"
        else:
            free, where = config_module.host_available_bytes(), "host memory has"
        if free and need > 0.9 * free:
            raise ValueError(
                f"reuse_stage1_attention keeps stage 1's attention outputs of all {tokens} tokens until stage 2 "
                f"({need / 2**30:.1f} GiB), but {where} {free / 2**30:.1f} GiB free: turn it off or shorten the "
                f"sequence" + ("." if self.config.offload or self.device.type != "cuda"
                               else ", or offload (they then go to host memory)."))

    def _sequence(self, input_ids, labels, scale: float, timings: dict, total: torch.Tensor,
                  last_sequence: bool = True) -> None:
        """Forward + backward of one sequence (host tensors [tokens]); adds its scaled loss to total."""
        tokens = input_ids.shape[0]
        chunks = self._chunks(tokens)
        count = len(chunks)
        # Position t predicts labels[t + 1]; the last position predicts nothing.
        targets = torch.cat([labels[1:], labels.new_full((1,), IGNORE_INDEX)])
        if self.config.reuse_stage1_attention:
            self._check_stage1_output_room(tokens)
        shared = {"summaries": {}, "selections": {},
                  # Note [Stage 1's attention in stage 2] in hf_attention.py
                  "stage1_outputs": {} if self.config.reuse_stage1_attention else None}
        self.rotary.reset(self.device)
        self.store.open_sequence(self._layout(tokens))
        try:
            started = time.perf_counter()
            per_chunk = timings.get("chunk_seconds")
            lap = _LapClock(self.device) if per_chunk is not None else None
            heartbeat = _Heartbeat.from_environment(count)
            self.store.plan(self._stage1_plan(chunks, shared))
            with torch.no_grad():
                for chunk, bounds in enumerate(chunks):
                    with chunk_context(self._context(1, chunk, chunks, shared)):
                        self._run_decoder(input_ids[bounds[0]: bounds[1]], bounds[0])
                    if per_chunk is not None:
                        per_chunk["stage1"].append(lap())
                    if heartbeat:
                        heartbeat("stage 1", chunk + 1)
            middle = time.perf_counter()
            timings["stage1_seconds"] += middle - started

            self.store.plan(self._stage2_plan(chunks, shared))
            page_tokens = self.config.page_tokens
            for chunk in reversed(range(count)):
                if per_chunk is not None and len(per_chunk["stage2"]) >= per_chunk["stage2_limit"]:
                    break   # Note [Partial steps]
                first, end = chunks[chunk]
                context = self._context(2, chunk, chunks, shared)
                with chunk_context(context):
                    hidden = self._run_decoder(input_ids[first:end], first)
                    loss = self._chunk_loss(hidden, targets[first:end])
                    if loss is None:
                        if not context.later_chunks:
                            # The last chunk has no target and no later chunk sent it gradient:
                            # its backward would add nothing anywhere.
                            del hidden
                            self.store.free_pages(first // page_tokens, -(-(end - first) // page_tokens))
                            _drop_stage1_outputs(shared, chunk)
                            continue
                        # Later chunks left gradient in this chunk's K/V pages; carry it through
                        # with a zero loss that keeps the graph.
                        loss = hidden.sum() * 0.0
                    if chunk == 0 and last_sequence and self._before_last_backward is not None:
                        self._before_last_backward()   # the step's last backward
                    (loss * scale).backward()
                    total += loss.detach().double() * scale
                self.store.free_pages(first // page_tokens, -(-(end - first) // page_tokens))
                _drop_stage1_outputs(shared, chunk)
                if per_chunk is not None:
                    per_chunk["stage2"].append(lap())
                if heartbeat:
                    heartbeat("stage 2", count - chunk)
            timings["stage2_seconds"] += time.perf_counter() - middle
        finally:
            self.store.close_sequence()
            self.last_selections = shared["selections"]
            if shared.get("stage1_outputs"):
                shared["stage1_outputs"].clear()


def _drop_stage1_outputs(shared: dict, chunk: int) -> None:
    """Stage 1's kept attention outputs of a chunk that stage 2 has passed (Note [Stage 1's
    attention in stage 2] in hf_attention.py)."""
    if shared.get("stage1_outputs") is not None:
        shared["stage1_outputs"].pop(chunk, None)


class _Heartbeat:
    """MEMBAR_PROGRESS_SECONDS=N: a line on stderr at most every N seconds saying how far a long step
    got ("[oomb] stage 2: 120 of 256 chunks after 301 s"), so that a step stopped from outside (a
    time limit) still tells how far it came. Host time: the GPU may be a few kernels behind."""

    def __init__(self, seconds: float, chunks: int):
        self.seconds, self.chunks = seconds, chunks
        self.started = self.last = time.perf_counter()

    @classmethod
    def from_environment(cls, chunks: int) -> "_Heartbeat | None":
        try:
            seconds = float(os.environ.get("MEMBAR_PROGRESS_SECONDS", "0"))
        except ValueError:
            return None
        return cls(seconds, chunks) if seconds > 0 else None

    def __call__(self, stage: str, done: int) -> None:
        now = time.perf_counter()
        if now - self.last >= self.seconds or done == self.chunks:
            self.last = now
            print(f"[oomb] {stage}: {done} of {self.chunks} chunks after {now - self.started:.0f} s",
                  file=sys.stderr, flush=True)


class _LapClock:
    """Seconds since the previous call (the first: since construction), once the GPU has caught up:
    per-chunk timing of partial steps only (it waits for the GPU every chunk)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.last = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def __call__(self) -> float:
        now = self._now()
        elapsed, self.last = now - self.last, now
        return elapsed


def _waits_by_kind(before: dict, after: dict) -> dict:
    """The step's timed stream waits per access kind and phase (StoreStats.stream_wait_by_kind):
    {label: {"seconds", "waits", "longest_ms"}} (the longest over the store's life)."""
    step = {}
    for label, (ns, waits, longest) in after.items():
        ns0, waits0, _ = before.get(label, (0, 0, 0))
        if waits > waits0:
            step[label] = {"seconds": (ns - ns0) * 1e-9, "waits": waits - waits0, "longest_ms": longest * 1e-6}
    return step


# Note [Partial steps]
#   A whole step at a million tokens of a 7B model takes longer than a benchmark can wait
#   (attention grows with the square of the context). A partial step runs all of stage 1 (every
#   page of the sequence is written, so memory holds what a whole step holds) and the first N
#   chunks of stage 2, which are the sequence's last chunks: the longest histories, where stage 2
#   peaks. Every chunk is timed after a GPU synchronization. Two estimates of the whole step:
#   an upper bound (a chunk's stage 2 grows with its history, so none costs more than the mean of
#   the longest-history ones that ran: stage 1 + chunks * that mean), and a ratio estimate (stage 2
#   of a chunk costs about r times its stage 1 when attention over the same history dominates both:
#   stage 1 * (1 + r), r measured on the chunks that ran; it overestimates when fixed per-chunk
#   costs dominate, as in tiny models). The gradient of a partial step is not the sequence's.
def _partial_step_estimate(chunk_seconds: dict, stage1_seconds: float) -> dict:
    stage1, stage2 = chunk_seconds["stage1"], chunk_seconds["stage2"]
    ran = len(stage2)
    # stage2[i] is chunk (count - 1 - i); stage1 is indexed by chunk.
    matched = [stage1[len(stage1) - 1 - i] for i in range(ran)]
    ratio = sum(stage2) / sum(matched) if sum(matched) > 0 else float("nan")
    estimate = stage1_seconds + ratio * stage1_seconds
    upper = stage1_seconds + len(stage1) * sum(stage2) / max(ran, 1)
    return {"partial_step": True, "stage2_chunks_run": ran, "stage2_chunks_total": len(stage1),
            "stage2_to_stage1_ratio": ratio, "estimated_step_seconds": estimate,
            "step_seconds_upper_bound": upper,
            "chunk_seconds": {"stage1": stage1, "stage2": stage2}}
