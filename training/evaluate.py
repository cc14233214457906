"""Held-out loss of a causal LM on a token stream, the way the model card reports it.

The protocol (also what a later `ruvllm eval ppl` should reproduce): tokenize the
whole text once, `<|endoftext|>` first; cut it into windows of `context + 1` tokens
that overlap by one token, so every token after the first is predicted exactly once,
from the tokens before it in its window; average the negative log-likelihood.
Per-byte and per-character figures divide the same total by the text's length, so
they compare across tokenizers.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

__all__ = ["EvalResult", "evaluate", "windows"]


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Total NLL (nats) over `tokens` predicted tokens of a text of `chars`/`bytes`."""

    nll: float
    tokens: int
    chars: int
    bytes: int

    @property
    def loss(self) -> float:
        """Mean NLL per token (nats)."""
        return self.nll / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float:
        return self.nll / math.log(2) / self.bytes

    @property
    def char_perplexity(self) -> float:
        return math.exp(self.nll / self.chars)

    def as_dict(self) -> dict[str, float]:
        return {"loss": self.loss, "perplexity": self.perplexity, "bits_per_byte": self.bits_per_byte,
                "char_perplexity": self.char_perplexity, "tokens": self.tokens, "chars": self.chars,
                "bytes": self.bytes}


def windows(ids: torch.Tensor, context: int) -> list[torch.Tensor]:
    """(n,) ids -> windows of up to context + 1 ids, each starting at the last id of the one before."""
    return [ids[start: start + context + 1] for start in range(0, len(ids) - 1, context)]


@torch.no_grad()
def evaluate(model: torch.nn.Module, ids: torch.Tensor, context: int, text: str | None = None,
             max_windows: int | None = None, batch_size: int = 16) -> EvalResult:
    """NLL of `ids` (1-D, starting with <|endoftext|>) under `model` (an HF causal LM).

    `text` is the decoded text, for the per-byte figures; with `max_windows` only a
    prefix is scored (quick evaluations during training), and chars/bytes are
    pro-rated by tokens.
    """
    was_training = model.training
    model.eval()
    chunks = windows(ids, context)[:max_windows]
    nll, count = 0.0, 0
    for i in range(0, len(chunks), batch_size):
        batch = chunks[i: i + batch_size]
        # The last window may be short: score full windows together, a short one alone.
        for group in ([c for c in batch if len(c) == context + 1], [c for c in batch if len(c) != context + 1]):
            if not group or len(group[0]) < 2:
                continue
            x = torch.stack(group)                       # (b, t + 1)
            logits = model(input_ids=x[:, :-1]).logits   # (b, t, vocab)
            nll += F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum").item()
            count += x[:, 1:].numel()
    model.train(was_training)
    text = text or ""
    scale = count / max(len(ids) - 1, 1)
    return EvalResult(nll, count, round(len(text) * scale), round(len(text.encode("utf-8")) * scale))
