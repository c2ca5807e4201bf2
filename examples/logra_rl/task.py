"""The verifiable task of the RL example: two-digit addition with a fixed answer format.

Prompt  "<bos> a1 a0 + b1 b0 ="  (7 tokens, numbers zero-padded to two digits)
Answer  "s2 s1 s0 <eos>"          (4 tokens, the sum zero-padded to three digits)
Reward  the fraction of the three answer digits that are right, 0 when the format is broken
        (a non-digit among the first three tokens or no <eos> after them).
"""
from __future__ import annotations

import torch

DIGITS = "0123456789"
PLUS, EQUALS, BOS, EOS, PAD = 10, 11, 12, 13, 14
VOCAB_SIZE = 16
PROMPT_TOKENS = 7
ANSWER_TOKENS = 4


def sample_problems(count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns a, b [count] in [0, 100)."""
    a = torch.randint(0, 100, (count,), generator=generator)
    b = torch.randint(0, 100, (count,), generator=generator)
    return a, b


def encode_prompts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[count, 7] token ids."""
    columns = [torch.full_like(a, BOS), a // 10, a % 10, torch.full_like(a, PLUS), b // 10, b % 10,
               torch.full_like(a, EQUALS)]
    return torch.stack(columns, dim=1)


def encode_answers(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[count, 4] token ids of the correct answer."""
    total = a + b
    return torch.stack([total // 100, (total // 10) % 10, total % 10, torch.full_like(a, EOS)], dim=1)


def rewards(answers: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(reward [count] in [0, 1], exact [count] bool) for generated answers [count, 4]."""
    correct = encode_answers(a, b).to(answers.device)
    format_ok = (answers[:, :3] < 10).all(dim=1) & (answers[:, 3] == EOS)
    digits_right = (answers[:, :3] == correct[:, :3]).float().mean(dim=1)
    reward = torch.where(format_ok, digits_right, torch.zeros_like(digits_right))
    return reward, format_ok & (answers[:, :3] == correct[:, :3]).all(dim=1)


@torch.no_grad()
def generate(model, prompts: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Samples ANSWER_TOKENS tokens after each prompt [count, 7] with a KV cache. [count, 4]."""
    was_training = model.training
    model.eval()
    output = model(input_ids=prompts, use_cache=True)
    cache = output.past_key_values
    logits = output.logits[:, -1, :].float()
    tokens = []
    for position in range(ANSWER_TOKENS):
        if temperature > 0:
            probabilities = torch.softmax(logits / temperature, dim=-1)
            token = torch.multinomial(probabilities.cpu(), 1, generator=generator).to(prompts.device)
        else:
            token = logits.argmax(dim=-1, keepdim=True)
        tokens.append(token)
        if position + 1 < ANSWER_TOKENS:
            output = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache = output.past_key_values
            logits = output.logits[:, -1, :].float()
    model.train(was_training)
    return torch.cat(tokens, dim=1)


def tiny_qwen2_config():
    from transformers import Qwen2Config

    # About 1M parameters: 4 layers, hidden 128, MLP 512.
    return Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=512, max_position_embeddings=32,
                       tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
