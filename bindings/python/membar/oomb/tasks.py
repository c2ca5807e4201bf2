"""Synthetic long-range tasks for training and demos.

PasskeyTask: a key token sits right after a KEY marker (the pair repeated key_repeats times, as
a passkey prompt states its key more than once) somewhere early in the sequence; after at
least `distance` filler tokens a QUERY marker asks for it. As in the usual passkey test, the filler
is a short random "sentence" repeated (filler_period tokens; 0 = independent random tokens), so
the haystack is regular and only the key is news. Only the answer is trained (all other
labels are -100) and scored: accuracy is the share of sequences whose most likely next token at
the QUERY marker is the key. Key tokens never appear in the filler, so a model that cannot see
>= distance tokens back can only guess (1 / num_keys).

RecallTask (what `membar-train --demo` trains): the sequence opens with the key (one token,
repeated to fill key_tokens tokens; with key_marker, as (KEY marker, key) pairs), then `distance` independent random filler tokens, then `queries` + 1
QUERY markers. The first `queries` markers are each trained to predict the key (the keys of one
batch are distinct, so favouring one key cannot lower a step's loss); the answer is
never fed back into the input, so every answer must come from the opening, at least `distance`
tokens back. The key's fixed place and its many copies make this the easiest long-range task to
learn from scratch: a model that sees the whole sequence learns it in tens of steps, and one
shown only the last few thousand tokens can only guess.

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


@dataclass
class RecallBatch:
    input_ids: torch.Tensor      # [batch, tokens]
    labels: torch.Tensor         # [batch, tokens]: the key at each answer position, -100 elsewhere
    query_positions: list        # positions of the trained QUERY markers (each predicts the key)
    keys: torch.Tensor           # [batch]

    @property
    def query_position(self) -> int:
        """The first question (scored by passkey_accuracy)."""
        return self.query_positions[0]


class RecallTask:
    """The key opens the sequence; after `distance` filler tokens, `queries` questions ask for it."""

    KEY_MARKER = 0
    QUERY_MARKER = 1

    def __init__(self, vocab_size: int, distance: int, num_keys: int = 8, key_tokens: int = 1,
                 queries: int = 1, seed: int = 0, key_marker: bool = False):
        if num_keys < 2:
            raise ValueError(f"num_keys must be >= 2, got {num_keys}.")
        if vocab_size < 2 + num_keys + 8:
            raise ValueError(f"vocab_size {vocab_size} leaves too few filler tokens for {num_keys} keys.")
        if key_tokens < 1 or queries < 1 or distance < 1:
            raise ValueError(f"key_tokens, queries and distance must be >= 1, got {key_tokens}, {queries}, "
                             f"{distance}.")
        self.vocab_size, self.distance, self.num_keys = vocab_size, distance, num_keys
        if key_marker and key_tokens < 2:
            raise ValueError(f"a key statement with KEY markers needs key_tokens >= 2, got {key_tokens}.")
        self.key_tokens, self.queries, self.key_marker = key_tokens, queries, key_marker
        # The last key copy is at key_tokens - 1 and the first question at key_tokens + distance, so
        # every question is more than `distance` tokens after the key; one more QUERY marker at the
        # end carries the last answer's label.
        self.tokens = key_tokens + distance + queries + 1
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, size: int = 1) -> RecallBatch:
        tokens, generator = self.tokens, self.generator
        first_filler = 2 + self.num_keys
        input_ids = torch.randint(first_filler, self.vocab_size, (size, tokens), generator=generator)
        # The keys of a batch are as balanced as they can be (distinct while size <= num_keys), so a
        # step cannot lower its loss by favouring one key: only recalling the key helps.
        rounds = -(-size // self.num_keys)
        keys = torch.cat([torch.randperm(self.num_keys, generator=generator) for _ in range(rounds)])[:size] + 2
        input_ids[:, :self.key_tokens] = keys.unsqueeze(1)
        if self.key_marker:
            input_ids[:, 0:self.key_tokens:2] = self.KEY_MARKER
        first_query = self.key_tokens + self.distance
        input_ids[:, first_query:] = self.QUERY_MARKER
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        # Position t is trained on labels[t + 1]: the questions at first_query .. tokens - 2.
        labels[:, first_query + 1:] = keys.unsqueeze(1)
        return RecallBatch(input_ids, labels, list(range(first_query, tokens - 1)), keys)


def passkey_accuracy(trainer, task, sequences: int, window: int | None = None, batches=None) -> float:
    """Share of sequences whose key the model predicts at the (first) QUERY marker.

    task: PasskeyTask or RecallTask (fresh sequences are drawn from it), or batches: a list of
    prepared one-sequence batches (a fixed held-out set). window: show the model only the last
    `window` tokens of each sequence (the question, but not the key when it lies further back).
    """
    if batches is None:
        batches = [task.batch(1) for _ in range(sequences)]
    correct = 0
    for batch in batches:
        input_ids, position = batch.input_ids[0], batch.query_position
        if window is not None and window < input_ids.shape[0]:
            cut = input_ids.shape[0] - window
            if position < cut:
                raise ValueError(f"a window of {window} tokens does not reach the question at {position}.")
            input_ids, position = input_ids[cut:], position - cut
        logits = trainer.predict(input_ids, [position])   # [1, vocab]
        correct += int(int(logits[0].argmax()) == int(batch.keys[0]))
    return correct / len(batches)
