"""What a benchmark sends: random-token prompts of a fixed length and a fixed generation length.

Random token ids, as vLLM's benchmark_serving `--dataset-name random` does:
the prompt length is exact (no tokenizer round trip) and two prompts share no
prefix, so the prefix cache cannot flatter the numbers. Every (seed, label)
gives its own prompts: a warmup, each concurrency level and each iteration
draw different ones. Generation ignores EOS, so every request makes exactly
gen_len tokens. Stdlib only.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

RESERVED_LOW_IDS = 3  # skip the first few ids, where tokenizers keep their specials (<unk>, <s>, </s>)


def random_prompts(count: int, length: int, vocab_size: int, seed: int, label: str = "") -> list[list[int]]:
    """`count` prompts of `length` ids drawn uniformly from [RESERVED_LOW_IDS, vocab_size)."""
    if length < 1 or vocab_size <= RESERVED_LOW_IDS:
        raise ValueError(f"need length >= 1 and vocab_size > {RESERVED_LOW_IDS}, got {length} and {vocab_size}")
    rng = random.Random(f"{seed}/{label}")
    return [[rng.randrange(RESERVED_LOW_IDS, vocab_size) for _ in range(length)] for _ in range(count)]


@dataclass(frozen=True)
class Workload:
    prompt_len: int = 128
    gen_len: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.gen_len < 1:
            raise ValueError(f"prompt and generation lengths must be >= 1, got {self.prompt_len}, {self.gen_len}")

    def prompts(self, count: int, vocab_size: int, label: str) -> list[list[int]]:
        return random_prompts(count, self.prompt_len, vocab_size, self.seed, label)
