"""Dense chunk attention through cuDNN's fused attention (the kernels torch's SDPA runs on Hopper).

Note [cuDNN for dense history]
  Rationale: the full-sequence baseline (HF, SDPA) runs cuDNN's sm90 wgmma attention on an H200:
  ~630-670 TFLOP/s forward and ~520-610 backward at the 7B shape (bench/sdpa_backends.py), about
  twice membar's own paged kernels (FlashAttention-2 class). Chunk-recurrent training computes the
  same attention FLOPs as full-sequence training, so its step time can only approach the baseline's
  with kernels of that class.
  Approach: when a chunk's history pages are consecutive rows of their pool (every dense access of
  the runtime's store: a space's pages are contiguous, Note [Runtime pages] in runtime_store.py),
  the history is one strided tensor [tokens, Hkv, D] and needs no page table. The forward is two fused
  calls, history (no mask) and the chunk itself (causal, aligned at the top left as the chunk's
  queries and keys start at the same position), merged by log-sum-exp. The backward runs each part
  with the MERGED out and lse (P = exp(s - lse_final), D = rowsum(dO * O_final): ring attention's
  identity, Note [Blocked history] in attention.h), sums dq in float32, returns the chunk's dk/dv
  and ADDS the history's dk/dv into the grad pages in place, like the paged backward.
  Limitations: cuDNN writes each call's dq/dk/dv in the input dtype, so a history page's gradient
  is rounded to bf16 once per chunk before its float32 accumulation (membar's kernel adds fp32
  partial sums); its backward is not run-to-run deterministic, so deterministic mode, sparse
  selections, page tables that are not consecutive rows, float32/float64 inputs and the CPU keep
  membar's kernels. Used on sm90 or newer only (where it was measured faster).

Note [When cuDNN is not used]
  Rationale: a cuDNN call can fail for a shape its fused kernels do not take (a head size, a
  layout); membar's kernels then run that call. Turning the fast path off for the whole process on
  any RuntimeError, as a first version did, also turned it off on an out-of-memory error, which is
  no property of the shape and must reach the caller.
  Approach: the decision is per shape (device, dtype, query heads, key/value heads, head size,
  forward or backward): the first failure of a shape is logged once, with the reason, and that
  shape runs on membar's kernels from then on; other shapes keep cuDNN. An out-of-memory error
  (torch.OutOfMemoryError, or cuDNN's allocation failure) is re-raised, never recorded. A failed
  backward leaves the grad pages untouched, so the caller can redo it with membar's kernels.
"""
from __future__ import annotations

import logging

import torch

from ..attention import merge_attention

log = logging.getLogger("membar.oomb")

_failed_shapes: dict = {}        # shape key -> why cuDNN failed there (Note [When cuDNN is not used])
_philox: dict = {}                # device -> (seed, offset) placeholders (dropout is always 0)
calls = {"forward": 0, "backward": 0}   # calls served here (tests and benchmarks read them)
MIN_CHUNK_TOKENS = 64                    # shorter chunks run on membar's kernels


def shape_key(q: torch.Tensor, k: torch.Tensor, kind: str) -> tuple:
    """What decides whether cuDNN takes a call (Note [When cuDNN is not used])."""
    return (str(q.device), q.dtype, q.shape[1], k.shape[1], q.shape[-1], kind)


def usable(q: torch.Tensor, history, selected, deterministic: bool, kernel: str, k: torch.Tensor | None = None,
           kind: str = "forward") -> bool:
    """Whether a dense attention call with these arguments can go through cuDNN."""
    if kernel == "membar":
        return False
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in (64, 128):
        return False
    if q.shape[0] < MIN_CHUNK_TOKENS:   # a short tail chunk: not worth a fused call (or a failed one)
        return False
    if deterministic or selected is not None or history.page_map is not None or history.v_page_index is not None:
        return False
    if history.history_tokens > 0 and history.first_row is None:
        return False
    if k is not None and shape_key(q, k, kind) in _failed_shapes:
        return False
    return (torch.cuda.get_device_capability(q.device) >= (9, 0) and torch.backends.cudnn.is_available()
            and torch.backends.cudnn.enabled)


def attempt(kind: str, q: torch.Tensor, k: torch.Tensor, call):
    """call()'s result, or None when cuDNN failed for this shape (recorded and logged once: membar's
    kernels take it from then on). Out-of-memory errors are raised (Note [When cuDNN is not used])."""
    try:
        return call()
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as error:
        text = str(error)
        if "out of memory" in text.lower() or "ALLOC_FAILED" in text:
            raise
        key = shape_key(q, k, kind)
        reason = text.splitlines()[0] if text else type(error).__name__
        if key not in _failed_shapes:
            log.warning("cuDNN attention %s fails for %s, %d query heads, %d key/value heads, head size %d (%s): "
                        "membar's kernels run this shape from now on.", kind, q.dtype, q.shape[1], k.shape[1],
                        q.shape[-1], reason)
        _failed_shapes[key] = reason
        return None


def disabled_reason() -> str | None:
    """Why cuDNN failed for the shapes it failed for, or None when it never failed."""
    if not _failed_shapes:
        return None
    return "; ".join(f"{key[5]} {key[1]} heads {key[2]}/{key[3]} head size {key[4]}: {reason}"
                     for key, reason in _failed_shapes.items())


def rows(pool: torch.Tensor, first_row: int, tokens: int) -> torch.Tensor:
    """Consecutive pages of a pool [pages, page_tokens, Hkv, D] from first_row, as [tokens, Hkv, D]."""
    page_tokens = pool.shape[1]
    pages = -(-tokens // page_tokens)
    return pool[first_row: first_row + pages].reshape((pages * page_tokens,) + tuple(pool.shape[2:]))[:tokens]


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [1, H, T, D] (a view: cuDNN reads strided tensors)."""
    return x.unsqueeze(0).transpose(1, 2)


def _thd(x: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] -> [T, H, D] (a view)."""
    return x[0].transpose(0, 1)


def _part_forward(q, k, v, causal: bool, scale: float):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal, False, scale=scale)[:2]
    return _thd(out), lse.reshape(q.shape[1], q.shape[0])


def forward(q, k, v, history_k, history_v, scale: float, attend_chunk: bool = True):
    """(out [Tc, Hq, D] in q's dtype, lse [Hq, Tc] float32) of q over history_k/v ([L, Hkv, D] or
    None) and, when attend_chunk, over the chunk's own k/v causally."""
    calls["forward"] += 1
    parts = []
    if history_k is not None and history_k.shape[0] > 0:
        parts.append(_part_forward(q, history_k, history_v, False, scale))
    if attend_chunk:
        parts.append(_part_forward(q, k, v, True, scale))
    if not parts:
        raise ValueError("cudnn_attention.forward: no keys to attend (no history and attend_chunk=False).")
    if len(parts) == 1:
        out, lse = parts[0]
        return out.contiguous(), lse.float()
    return merge_attention([(out, lse.float()) for out, lse in parts])


def _placeholders(device: torch.device):
    placeholders = _philox.get(device)
    if placeholders is None:
        placeholders = (torch.zeros((), dtype=torch.int64, device=device),
                        torch.zeros((), dtype=torch.int64, device=device))
        _philox[device] = placeholders
    return placeholders


def _part_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    seed, offset = _placeholders(q.device)
    tokens, heads = q.shape[0], q.shape[1]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.reshape(1, heads, tokens, 1), seed, offset,
        None, None, None, tokens, k.shape[0], 0.0, causal, scale=scale)
    return _thd(dq), _thd(dk), _thd(dv)


def backward(q, k, v, history_k, history_v, out, dout, lse, scale: float, dk_rows, dv_rows,
             attend_chunk: bool = True):
    """dq [Tc, Hq, D], dk, dv [Tc, Hkv, D] of the chunk (zeros when not attend_chunk); ADDS the
    history's dK/dV into dk_rows/dv_rows ([L, Hkv, D] views of the grad pages, float32 or bf16).
    out and lse must be the rows' final (merged) ones."""
    calls["backward"] += 1
    out = out.contiguous()
    lse = lse.float().contiguous()
    history = None
    if history_k is not None and history_k.shape[0] > 0:
        history = _part_backward(dout, q, history_k, history_v, out, lse, False, scale)
    own = _part_backward(dout, q, k, v, out, lse, True, scale) if attend_chunk else None
    if history is None and own is None:
        raise ValueError("cudnn_attention.backward: no keys were attended.")
    # Both calls succeeded: only now touch the grad pages (a failed call leaves them as they were,
    # so the caller can redo the whole backward with membar's kernels).
    dq = None
    if history is not None:
        dq_h, dk_h, dv_h = history
        dk_rows.add_(dk_h)
        dv_rows.add_(dv_h)
        dq = dq_h.float()
    if own is not None:
        dq_c, dk, dv = own
        dk, dv = dk.contiguous(), dv.contiguous()
        dq = dq_c if dq is None else dq.add_(dq_c)
    else:
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    return dq.to(q.dtype).contiguous(), dk, dv
