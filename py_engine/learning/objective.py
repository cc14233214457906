"""What the loops train on: a prompt and the assistant tokens after it, scored by cross-entropy.

An `Example` is a prompt's token ids (the chat template's rendering, as the
server logged it) and the target ids the model should continue with: the
correction's tokens plus the end-of-turn token, or, for an accepted answer,
the tokens the model produced. Only the target tokens are scored; the prompt
is context.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class Example:
    prompt_ids: tuple[int, ...]
    target_ids: tuple[int, ...]


def example_from_feedback(record: dict[str, Any], tokenizer: Any, eos_id: int | None, max_target: int,
                          max_len: int) -> Example | None:
    """The example a feedback record teaches: its correction, else an accepted (rating 1) output; None
    for a bare negative rating (logged, not trained on) or an empty target."""
    prompt = list((record.get("prompt") or {}).get("token_ids") or [])
    if record.get("correction"):
        target = tokenizer.encode(record["correction"], add_special_tokens=False)
        target = target[:max_target] + ([eos_id] if eos_id is not None else [])
    elif record.get("rating") == 1:
        target = list((record.get("output") or {}).get("token_ids") or [])[:max_target]
    else:
        return None
    if not target or not prompt:  # the first target token needs a position before it
        return None
    prompt = prompt[-max(1, max_len - len(target)):]  # the prompt's end is the context that matters
    return Example(tuple(prompt), tuple(target))


def batch_nll(model: nn.Module, examples: Sequence[Example]) -> tuple[Tensor, int]:
    """Summed target-token NLL of a batch (right-padded; causal attention never sees the padding) and the
    number of target tokens."""
    device = next(model.parameters()).device
    rows = [list(e.prompt_ids) + list(e.target_ids) for e in examples]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # label t: the token after position t
    for b, (e, row) in enumerate(zip(examples, rows)):
        ids[b, :len(row)] = torch.tensor(row)
        p = len(e.prompt_ids)
        labels[b, p - 1:len(row) - 1] = torch.tensor(e.target_ids)
    ids, labels = ids.to(device), labels.to(device)
    positions = torch.arange(width, device=device)[None].expand(len(rows), width)
    logits = model(ids, positions)  # [B, T, V] float32
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")
    return loss, int((labels != -100).sum())


@torch.no_grad()
def mean_nll(model: nn.Module, examples: Sequence[Example], batch_size: int = 8) -> float:
    """Mean NLL per target token over the examples (evaluation)."""
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        loss, n = batch_nll(model, examples[i:i + batch_size])
        total, count = total + float(loss), count + n
    return total / max(count, 1)
