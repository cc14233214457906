"""A few Adam steps on a LoRA: cross-entropy on target tokens, plus the EWC penalty when given, plus an
anchor term when given: KL(reference || adapted) of the next-token distribution at the end of other
prompts, so an adapter taught one answer does not give it to every question (the instant loop's).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from .ewc import ewc_penalty
from .lora import TrainableLora
from .objective import Example, batch_nll


@dataclass
class TrainStats:
    steps: int
    first_loss: float  # mean target NLL at the first step
    last_loss: float
    seconds: float


def train_lora(model: nn.Module, lora: TrainableLora, examples: Sequence[Example], *, steps: int | None = None,
               epochs: int = 1, batch_size: int = 8, lr: float = 1e-2, fisher: dict[str, Tensor] | None = None,
               ewc_lambda: float = 0.0, seed: int = 0, anchors: Anchors | None = None,
               progress: Callable[[int, int, float], None] | None = None) -> TrainStats:
    """Train `lora` (the base model stays frozen). `steps`: that many steps on the whole set as one
    batch (the instant loop); otherwise `epochs` passes in shuffled batches of `batch_size`."""
    start = time.perf_counter()
    if not examples:
        return TrainStats(0, float("nan"), float("nan"), 0.0)
    if steps is not None:
        batches = [list(examples)] * steps
    else:
        order, rng, batches = list(examples), random.Random(seed), []
        for _ in range(epochs):
            rng.shuffle(order)
            batches += [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    optimizer = torch.optim.Adam(lora.parameters(), lr=lr)
    first = last = float("nan")
    use_ewc = fisher is not None and ewc_lambda > 0
    with lora.attached(model), torch.enable_grad():
        for k, batch in enumerate(batches):
            nll, count = batch_nll(model, batch)
            loss = nll / max(count, 1)
            last = float(loss.detach())
            first = last if k == 0 else first
            if use_ewc:
                loss = loss + ewc_lambda * ewc_penalty(lora, fisher)
            if anchors is not None:
                loss = loss + anchors.weight * anchors.kl(model)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if progress is not None:
                progress(k + 1, len(batches), last)
    return TrainStats(len(batches), first, last, time.perf_counter() - start)


@dataclass
class Anchors:
    """Prompts whose next-token distribution should stay the reference's (taken before training)."""

    prompts: list[list[int]]
    reference: Tensor  # [A, V] log-probs at each prompt's last position
    weight: float

    @classmethod
    @torch.no_grad()
    def of(cls, model: nn.Module, prompts: list[list[int]], weight: float) -> "Anchors":
        return cls(prompts, torch.log_softmax(_last_logits(model, prompts), -1), weight)

    def kl(self, model: nn.Module) -> Tensor:
        logp = torch.log_softmax(_last_logits(model, self.prompts), -1)
        return (self.reference.exp() * (self.reference - logp)).sum(-1).mean()


def _last_logits(model: nn.Module, prompts: list[list[int]]) -> Tensor:
    """Logits [A, V] at the last token of each prompt (right-padded batch)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
    device = next(model.parameters()).device
    positions = torch.arange(width, device=device)[None].expand(len(prompts), width)
    logits = model(ids.to(device), positions)  # [A, T, V]
    return logits[torch.arange(len(prompts)), torch.tensor([len(p) - 1 for p in prompts])]


def freeze(model: nn.Module) -> nn.Module:
    """No gradients for the base model's own weights: only LoRA matrices train."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model
