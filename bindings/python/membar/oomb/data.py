"""Long token sequences from files, for membar-train --data.

A file holds one stream of token ids; training cuts it into windows of seq_len tokens (the last
partial window is dropped) and visits them in a shuffled order, epoch after epoch:

  .pt    a torch tensor of integer ids (any shape; flattened), or a list of them (concatenated)
  .npy   a numpy array of integer ids (any shape; flattened)
  .bin   raw little-endian ids, uint16 by default (the nanoGPT format), see `dtype`
  .txt   text, tokenized with the model's tokenizer (the checkpoint directory must have one)
"""
from __future__ import annotations

import os

import torch

_RAW_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32, "int32": torch.int32, "int64": torch.int64}


def load_tokens(path: str, dtype: str = "uint16", tokenizer_path: str | None = None) -> torch.Tensor:
    """The file's token ids as a 1-D int64 tensor."""
    if not os.path.isfile(path):
        raise ValueError(f"--data {path}: no such file.")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".pt":
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:   # torch's own message may advise weights_only=False, which is unsafe
            raise ValueError(f"--data {path}: not a tensor saved with torch.save, or the file is damaged "
                             f"({type(error).__name__}).") from None
        if isinstance(data, (list, tuple)):
            data = torch.cat([torch.as_tensor(part).flatten() for part in data]) if data else torch.empty(0)
        if not isinstance(data, torch.Tensor):
            raise ValueError(f"--data {path}: expected a tensor (or a list of them) of token ids, got {type(data).__name__}.")
        tokens = data
    elif suffix == ".npy":
        import numpy

        with open(path, "rb") as file:
            magic = file.read(6)
        if magic != b"\x93NUMPY":
            # Without this check numpy takes the file for a pickle and suggests allow_pickle=True,
            # which would run whatever code the file holds.
            raise ValueError(f"--data {path}: not a .npy array file (no NumPy header); write token ids with "
                             f"numpy.save, or pass them as .bin, .pt or .txt.")
        try:
            array = numpy.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as error:
            raise ValueError(f"--data {path}: a damaged .npy file ({error}).") from None
        if array.dtype == object:
            raise ValueError(f"--data {path}: holds Python objects, not token ids.")
        tokens = torch.from_numpy(array)
    elif suffix == ".bin":
        if dtype not in _RAW_DTYPES:
            raise ValueError(f"--data-dtype must be one of {sorted(_RAW_DTYPES)}, got {dtype!r}.")
        raw = _RAW_DTYPES[dtype]
        size = os.path.getsize(path)
        element = torch.empty((), dtype=raw).element_size()
        if size % element:
            raise ValueError(f"--data {path}: {size} bytes is not a whole number of {dtype} ids.")
        tokens = torch.from_file(path, shared=False, size=size // element, dtype=raw)
    elif suffix == ".txt":
        if tokenizer_path is None or not os.path.isdir(tokenizer_path):
            raise ValueError(f"--data {path}: text needs the model's tokenizer; pass --model as a checkpoint "
                             f"directory that has one (or give token ids as .pt/.npy/.bin).")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        with open(path, encoding="utf-8") as handle:
            tokens = torch.tensor(tokenizer(handle.read(), add_special_tokens=False)["input_ids"], dtype=torch.int64)
    else:
        raise ValueError(f"--data {path}: unknown file type {suffix or '(none)'}; use .pt, .npy, .bin or .txt.")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
        raise ValueError(f"--data {path}: token ids must be integers, got {tokens.dtype}.")
    return tokens.flatten().to(torch.int64)


class TokenWindows:
    """Windows of seq_len consecutive tokens of one stream, served in batches, reshuffled each epoch."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, vocab_size: int, seed: int = 0):
        if tokens.dim() != 1:
            raise ValueError("TokenWindows takes a 1-D stream of token ids.")
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}.")
        if tokens.numel() < seq_len:
            raise ValueError(f"the data holds {tokens.numel()} tokens, fewer than one sequence of {seq_len}.")
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size}) for this model; the data has ids from "
                             f"{low} to {high}.")
        self.count = tokens.numel() // seq_len
        self.windows = tokens[: self.count * seq_len].view(self.count, seq_len)
        self.generator = torch.Generator().manual_seed(seed)
        self.order: list[int] = []
        self.epoch = 0

    def batch(self, size: int) -> torch.Tensor:
        """[size, seq_len] int64: the next windows (a new shuffled epoch starts when one runs out)."""
        rows = []
        while len(rows) < size:
            if not self.order:
                self.order = torch.randperm(self.count, generator=self.generator).tolist()
                self.epoch += 1
            rows.append(self.order.pop())
        return self.windows[rows]
