"""Synthetic long-range tasks for training and demos.

PasskeyTask: a key token sits right after a KEY marker (the pair repeated key_repeats times, as
a passkey prompt states its key more than once) somewhere early in the sequence; after at
least `distance` filler tokens a QUERY marker asks for it. As in the usual passkey test, the filler
is a short random "sentence" repeated (filler_period tokens; 0 = independent random tokens), so
the haystack is regular and only the key is news. Only the answer is trained (all other
labels are -100) and scored: accuracy is the share of sequences whose most likely next token at
the QUERY marker is the key. Key tokens never appear in the filler, so a model that cannot see
>= distance tokens back can only guess (1 / num_keys).

Token ids: 0 = KEY marker, 1 = QUERY marker, [2, 2 + num_keys) = keys, the rest = filler.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .trainer import IGNORE_INDEX


@dataclass
class PasskeyBatch:
    input_ids: torch.Tensor      # [batch, tokens]
    labels: torch.Tensor         # [batch, tokens]: the key after the QUERY marker, -100 elsewhere
    query_position: int          # position of the QUERY marker (its next-token logits are scored)
    keys: torch.Tensor           # [batch]


class PasskeyTask:
    KEY_MARKER = 0
    QUERY_MARKER = 1

    def __init__(self, vocab_size: int, tokens: int, distance: int, num_keys: int = 16, seed: int = 0,
                 filler_period: int = 8, key_repeats: int = 1):
        if num_keys < 2:
            raise ValueError(f"num_keys must be >= 2, got {num_keys}.")
        if vocab_size < 2 + num_keys + 8:
            raise ValueError(f"vocab_size {vocab_size} leaves too few filler tokens for {num_keys} keys.")
        if distance + 2 * key_repeats + 8 > tokens:
            raise ValueError(f"a sequence of {tokens} tokens cannot hold a key {distance} tokens before the question.")
        if key_repeats < 1:
            raise ValueError(f"key_repeats must be >= 1, got {key_repeats}.")
        self.key_repeats = key_repeats
        if filler_period < 0:
            raise ValueError(f"filler_period must be >= 0, got {filler_period}.")
        self.vocab_size, self.tokens, self.distance, self.num_keys = vocab_size, tokens, distance, num_keys
        self.filler_period = filler_period
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, size: int = 1) -> PasskeyBatch:
        tokens, generator = self.tokens, self.generator
        first_filler = 2 + self.num_keys
        if self.filler_period:
            sentence = torch.randint(first_filler, self.vocab_size, (size, self.filler_period), generator=generator)
            input_ids = sentence.repeat(1, -(-tokens // self.filler_period))[:, :tokens].contiguous()
        else:
            input_ids = torch.randint(first_filler, self.vocab_size, (size, tokens), generator=generator)
        keys = torch.randint(2, 2 + self.num_keys, (size,), generator=generator)
        query_position = tokens - 2
        # The key statement is key_repeats (KEY marker, key) pairs; its last key token lies at
        # least `distance` tokens before the QUERY marker.
        span = 2 * self.key_repeats
        latest_start = query_position - self.distance - span
        key_positions = torch.randint(0, latest_start + 1, (size,), generator=generator)
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        for row in range(size):
            start = int(key_positions[row])
            input_ids[row, start: start + span: 2] = self.KEY_MARKER
            input_ids[row, start + 1: start + span: 2] = keys[row]
            input_ids[row, query_position] = self.QUERY_MARKER
            input_ids[row, query_position + 1] = keys[row]
            labels[row, query_position + 1] = keys[row]
        return PasskeyBatch(input_ids, labels, query_position, keys)


def passkey_accuracy(trainer, task: PasskeyTask, sequences: int) -> float:
    """Share of fresh sequences whose key the model predicts at the QUERY marker."""
    correct = 0
    for _ in range(sequences):
        batch = task.batch(1)
        logits = trainer.predict(batch.input_ids[0], [batch.query_position])   # [1, vocab]
        correct += int(int(logits[0].argmax()) == int(batch.keys[0]))
    return correct / sequences
