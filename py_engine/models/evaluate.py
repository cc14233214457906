"""Perplexity of a causal LM on a text, with Hugging Face's sliding-window ("stride") method.

    result = perplexity(model, ids, window=256, stride=128)
    result.perplexity, result.tokens, result.nll

The token stream is cut into windows of `window` tokens (the model's context) whose starts are
`stride` apart; each window is one forward pass, and only the tokens no earlier window covered are
scored, so every token after the first is predicted exactly once and, past the first window, with at
least `window - stride` tokens of context. The first token has no context and is never scored. With
stride == window the windows do not overlap and each window's first token goes unscored (as in
Hugging Face's loop). Perplexity is exp(total NLL / scored tokens).

With a two-tier KV cache (`kv_quant`, kv_quant.py) each window runs over a fresh one, and every query
reads the blocks past its hot window dequantized, as token-by-token decoding would.

Windows of the same shape and scored span run as one batch, and the LM head computes logits only
for the scored positions (CausalLM's `logit_indices`). Ring 1 (torch).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

LOGITS_BUDGET = 1 << 25  # floats of logits one batch may hold (128 MiB)


@dataclass(frozen=True)
class PerplexityResult:
    nll: float  # total negative log-likelihood, nats
    tokens: int  # scored tokens
    window: int
    stride: int
    seconds: float

    @property
    def loss(self) -> float:
        """Mean NLL per scored token (nats)."""
        return self.nll / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    def to_dict(self) -> dict[str, Any]:
        return {"perplexity": self.perplexity, "nll": self.loss, "nll_sum": self.nll, "tokens": self.tokens,
                "window": self.window, "stride": self.stride, "seconds": round(self.seconds, 3)}


def sliding_windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over n tokens; tokens [first, end) are scored."""
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window, got window {window}, stride {stride}")
    spans, prev_end = [], 0
    for begin in range(0, max(n - 1, 0), stride):
        end = min(begin + window, n)
        first = max(prev_end, begin + 1)
        if first < end:
            spans.append((begin, end, first))
        prev_end = end
        if end == n:
            break
    return spans


@torch.inference_mode()
def perplexity(model: Any, ids: Sequence[int], window: int, stride: int | None = None,
               progress: Callable[[int, int], None] | None = None, kv_quant: Any = None) -> PerplexityResult:
    """Sliding-window perplexity of `ids` under a py_engine CausalLM (forward(ids, positions, logit_indices=))."""
    start = time.perf_counter()
    stride = stride or max(window // 2, 1)
    device = next(model.parameters()).device
    tokens = torch.tensor(list(ids), dtype=torch.long)
    spans = sliding_windows(len(tokens), window, stride)
    groups: dict[tuple[int, int], list[int]] = {}  # (length, scored offset) -> window starts
    for begin, end, first in spans:
        groups.setdefault((end - begin, first - begin), []).append(begin)
    vocab = model.config.vocab_size
    nll, count, done = 0.0, 0, 0
    for (length, offset), begins in groups.items():
        batch = max(1, LOGITS_BUDGET // (vocab * (length - offset)))
        scored = torch.arange(offset - 1, length - 1, device=device)  # positions whose logits predict the targets
        for i in range(0, len(begins), batch):
            rows = torch.stack([tokens[b: b + length] for b in begins[i: i + batch]]).to(device)  # [B, length]
            positions = torch.arange(length, device=device).expand(rows.shape[0], -1)  # [B, length]
            kv = None
            if kv_quant is not None and kv_quant.enabled:
                from .kv_cache import DenseKVCache
                kv = DenseKVCache.allocate(model.config, rows.shape[0], length, model.model.norm.weight.dtype,
                                           device, layers=getattr(model, "kv_layers", None), quant=kv_quant)
            logits = model(rows, positions, kv, logit_indices=scored)  # [B, length - offset, V]
            targets = rows[:, offset:]  # [B, length - offset]
            nll += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum").item()
            count += targets.numel()
            done += rows.shape[0]
            if progress:
                progress(done, len(spans))
    return PerplexityResult(nll, count, window, stride, time.perf_counter() - start)
