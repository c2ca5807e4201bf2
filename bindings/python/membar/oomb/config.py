"""Options of chunk-recurrent (OOMB) training."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

_GRAD_PAGE_DTYPES = {"float32": torch.float32, "fp32": torch.float32,
                     "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class OOMBConfig:
    """How a sequence is cut into chunks and where its pages live.

    chunk_tokens: tokens per chunk (a multiple of page_tokens). Activation memory is O(chunk).
    page_tokens: tokens per KV page (the kernels' tile: 128 on an H200; 64 also works).
    mode: "dense" (exact gradients) or "sparse" (top_k pages per query tile, chosen in stage 1 and
        reused in stage 2).
    top_k: history pages each query tile sees in sparse mode.
    query_tile_tokens: queries that share one sparse selection.
    offload: keep the K/V and dK/dV pages in (pinned) host memory and bring each layer's pages in
        ahead of use.
    gpu_resident_layers: with offload, GPU budget for this-many whole layers' pages on top of the
        streaming working set (use GPU memory left over beside host memory; see
        pool_bytes_per_layer to size it). The runtime decides which pages stay, by farthest next use.
    gpu_budget_bytes: with offload, the runtime's GPU budget for pages, replacing the default (a few
        history blocks plus gpu_resident_layers whole layers).
    prefetch_depth: how many accesses ahead an offloading store copies pages in.
    grad_page_dtype: float32 (default, exact) or bfloat16 for the dK/dV pages.
    deterministic: ask the backward kernel for run-to-run identical bits.
    loss_piece_tokens: the loss is computed this many tokens at a time, each piece checkpointed, so
        full-vocabulary logits of a whole chunk never exist at once (default 512: on the H200 the 7B
        dense-offload step at 32K peaked at 32.2 GiB with it, 33.2 GiB with 1024 and 39.3 GiB with
        4096, in 6.35 s, 6.36 s and 6.48 s, in one run).
    checkpoint_layers: recompute each decoder layer in backward (HF gradient checkpointing) to cut
        stage 2 activation memory further. The recompute reuses the attention output of the chunk's
        stage-2 forward (kept per layer until its backward), so attention is not computed a third time.
    history_block_tokens: with offload, a layer's history travels through the GPU in blocks of this
        many tokens (a multiple of page_tokens; 0 = the whole history at once; default 64K tokens
        rounded down to whole pages). Each block is one
        attention call without the chunk's own keys, merged by log-sum-exp with a chunk-only call, so
        GPU memory no longer grows with the sequence (Note [Streaming a layer's history] in
        hf_attention.py). Default 64K: on an H200 at 256K (Qwen2.5-7B shape) blocks of 64K cost
        +1.8% against pages kept on the GPU, blocks of 16K +8.0% (more, smaller attention calls
        and merges), for 0.3 GiB more GPU memory.
    reuse_stage1_attention: stage 2 takes each layer's attention output and log-sum-exp from stage 1
        instead of computing them again over the history (Note [Stage 1's attention in stage 2] in
        hf_attention.py): one attention forward less per layer and chunk, and no history read in
        stage 2's forward, for the outputs of the whole sequence kept until stage 2 uses them
        (hidden_size x dtype bytes + 4 x heads bytes per token and layer: ~7 KiB at the 7B shape,
        51 GiB at 256K), on the GPU, or in pinned host memory with offload. Off by default (not yet
        measured on a GPU).
    dense_kernel: "auto" (default): dense attention over consecutive pages runs on cuDNN's fused
        kernels (those torch's SDPA uses) on Hopper GPUs with bf16/fp16 models, unless deterministic
        is set (Note [cuDNN for dense history] in cudnn_attention.py); "membar": membar's paged
        kernels everywhere. Sparse mode and the CPU always use membar's kernels.
    """

    chunk_tokens: int = 4096
    page_tokens: int = 128
    mode: str = "dense"
    top_k: int = 64
    query_tile_tokens: int = 128
    offload: bool = False
    gpu_resident_layers: int = 0
    gpu_budget_bytes: int | None = None
    prefetch_depth: int = 2
    grad_page_dtype: torch.dtype = torch.float32
    deterministic: bool = False
    loss_piece_tokens: int = 512
    checkpoint_layers: bool = False
    history_block_tokens: int | None = None
    reuse_stage1_attention: bool = False
    dense_kernel: str = "auto"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.grad_page_dtype, str):
            name = self.grad_page_dtype.lower()
            if name not in _GRAD_PAGE_DTYPES:
                raise ValueError(f"grad_page_dtype must be float32 or bfloat16, not {self.grad_page_dtype!r}.")
            self.grad_page_dtype = _GRAD_PAGE_DTYPES[name]
        if self.history_block_tokens is None and self.page_tokens >= 1:
            self.history_block_tokens = max(self.page_tokens, 65536 // self.page_tokens * self.page_tokens)
        self.validate()

    @property
    def selection_pages(self) -> int:
        """selection_pages() of this configuration."""
        return selection_pages(self.mode, self.top_k, self.chunk_tokens, self.query_tile_tokens)

    def validate(self) -> None:
        """Raises ValueError with a sentence when an option is unusable."""
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {self.page_tokens}.")
        if self.chunk_tokens < 1 or self.chunk_tokens % self.page_tokens != 0:
            raise ValueError(
                f"chunk_tokens ({self.chunk_tokens}) must be a positive multiple of page_tokens "
                f"({self.page_tokens}) so that every chunk starts on a fresh page.")
        if self.mode not in ("dense", "sparse"):
            raise ValueError(f"mode must be 'dense' or 'sparse', got {self.mode!r}.")
        if self.mode == "sparse" and self.top_k < 1:
            raise ValueError(f"sparse mode needs top_k >= 1, got {self.top_k}.")
        if self.query_tile_tokens < 1:
            raise ValueError(f"query_tile_tokens must be >= 1, got {self.query_tile_tokens}.")
        if self.grad_page_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"grad_page_dtype must be torch.float32 or torch.bfloat16, got {self.grad_page_dtype}.")
        if self.loss_piece_tokens < 1:
            raise ValueError(f"loss_piece_tokens must be >= 1, got {self.loss_piece_tokens}.")
        if self.gpu_resident_layers < 0:
            raise ValueError(f"gpu_resident_layers must be >= 0, got {self.gpu_resident_layers}.")
        if self.history_block_tokens < 0 or self.history_block_tokens % self.page_tokens != 0:
            raise ValueError(f"history_block_tokens ({self.history_block_tokens}) must be 0 or a positive multiple "
                             f"of page_tokens ({self.page_tokens}): blocks hold whole pages.")
        if self.dense_kernel not in ("auto", "membar"):
            raise ValueError(f"dense_kernel must be 'auto' or 'membar', got {self.dense_kernel!r}.")
        if self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}.")


def selection_pages(mode: str, top_k: int, chunk_tokens: int, query_tile_tokens: int) -> int:
    """The most history pages one chunk's sparse selection names (top_k per query tile, every tile
    of a chunk): 0 in dense mode. With offload the store sizes one access's GPU room for this many
    scattered pages where that is at most a history block's pages (Note [Streaming a layer's
    history] in hf_attention.py)."""
    if mode != "sparse":
        return 0
    return top_k * -(-chunk_tokens // query_tile_tokens)


def pool_bytes_per_layer(tokens: int, page_tokens: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype, grad_page_dtype: torch.dtype) -> int:
    """Bytes of K, V, dK and dV pages one layer needs for a sequence of `tokens` tokens."""
    pages = -(-tokens // page_tokens)
    row = page_tokens * num_kv_heads * head_dim
    element = torch.empty((), dtype=dtype).element_size()
    grad_element = torch.empty((), dtype=grad_page_dtype).element_size()
    return 2 * pages * row * (element + grad_element)


@dataclass
class ResidencyPlan:
    """Where an offloading run keeps its pages: the first `gpu_resident_layers` layers on the GPU,
    the rest in host memory (`host_bytes` of pinned pools)."""
    gpu_resident_layers: int
    layer_bytes: int
    host_bytes: int


def plan_gpu_resident_layers(tokens: int, model_config, page_tokens: int, dtype: torch.dtype,
                             grad_page_dtype: torch.dtype, device_free_bytes: int, reserve_bytes: int,
                             host_available_bytes: int, host_margin: float = 0.92,
                             tensor_parallel: int = 1, reserve_for: str = "activations") -> ResidencyPlan:
    """How many layers' pages fit beside `reserve_bytes` of GPU memory left for activations, the
    others going to host memory: what an offloading run of a sequence too long for either memory
    alone needs (1M tokens of a 7B model: 28 layers x 6 GiB of K, V, dK, dV pages with fp32
    gradients). Raises ValueError when the host cannot hold the rest (more than `host_margin` of
    what it has available), naming the numbers, rather than letting pinned allocations fail later.
    tensor_parallel: the ranks the key/value heads are split over (each rank's pages hold its share).
    reserve_for: what the reserve is kept for, in the error's sentence."""
    text = getattr(model_config, "text_config", None) or model_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    layers = text.num_hidden_layers
    layer_bytes = pool_bytes_per_layer(tokens, page_tokens, text.num_key_value_heads // max(tensor_parallel, 1),
                                       head_dim, dtype, grad_page_dtype)
    resident = int(max(0, min(layers, (device_free_bytes - reserve_bytes) // layer_bytes)))
    host_bytes = (layers - resident) * layer_bytes
    if host_bytes > host_margin * host_available_bytes:
        raise ValueError(
            f"the K/V/dK/dV pages of {tokens:,} tokens need {layers * layer_bytes / 2**30:.1f} GiB "
            f"({layer_bytes / 2**30:.2f} GiB per layer): {resident} layers fit on the GPU beside "
            f"{reserve_bytes / 2**30:.1f} GiB kept for {reserve_for}, and the other {layers - resident} need "
            f"{host_bytes / 2**30:.1f} GiB of host memory, more than {host_margin:.0%} of the "
            f"{host_available_bytes / 2**30:.1f} GiB available. Shorten the sequence, use bfloat16 gradient "
            f"pages, or lower the GPU reserve.")
    return ResidencyPlan(resident, layer_bytes, host_bytes)


def host_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (0 where there is none)."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def parse_tokens(text) -> int:
    """A token count written as 32768, 32K or 1M (K = 1024)."""
    value = str(text).strip().upper()
    scale = {"K": 1024, "M": 1024 * 1024}.get(value[-1:], 1)
    number = value[:-1] if scale != 1 else value
    try:
        tokens = float(number) * scale
    except ValueError:
        raise ValueError(f"not a token count: {text!r} (write e.g. 32768, 32K or 1M)") from None
    if tokens != int(tokens) or tokens < 0:
        raise ValueError(f"not a whole, non-negative token count: {text!r}")
    return int(tokens)
