"""Consolidation with the gate: every pattern into one LoRA of the MicroLoRAs' shape, the base kept elsewhere.

    lora, stats = consolidate_patterns(model, config, examples, keep_ids)

The gated loop's MicroLoRAs sit on the last layer's down_proj, where the
layer below is fixed (instant.py): one frozen pass per pattern gives its
answer rows, and one LoRA of rank `rank` is fitted to all of them at once
with the instant update's cut softmax, for at most `consolidate_steps` steps
(stopping once every answer token wins). What holds the base is `Keep`: rows
of the base's own text (`keep_tokens`, sampled from the base, never the
validation text perplexity is measured on), whose next-token distribution over
their `KEEP_CANDIDATES` likeliest tokens and every answer token must stay the
base's (KL, weight `keep_weight`). That is the function-space form of what EWC
asks of the weights, and it measures: EWC strong enough to hold perplexity
kept all 50 facts out of an all-layer LoRA (benchmarks/README.md). A step is
small matrices only (the rows' down_proj inputs are fixed), so 50 patterns
consolidate in seconds.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from .config import SonaConfig
from .instant import Captured, InstantTrainer
from .lora import TrainableLora
from .objective import Example
from .train import TrainStats

KEEP_CANDIDATES = 32
KEEP_WINDOW = 128  # tokens per frozen pass over the kept text


@dataclass
class Keep:
    """Rows whose distribution must stay the base's: their captured inputs, their candidates' head rows
    [M, K, hidden], the answer tokens' head rows [U, hidden] (shared by every row) and the base's
    log-probabilities over [candidates, answers] renormalised [M, K + U]."""

    captured: Captured
    head: Tensor
    answers: Tensor
    base_logp: Tensor
    weight: float

    def bind(self, trainer: InstantTrainer, lora: TrainableLora):
        """The penalty as a function of the LoRA: weight * mean KL(base || adapted) over the rows."""
        layer_out, _ = trainer._layer_out(lora, self.captured)  # the caller attaches a hooked LoRA
        norm, p = trainer.model.model.norm, self.base_logp.exp()

        def penalty() -> Tensor:
            z = norm(layer_out())  # [M, hidden]
            logits = torch.cat([torch.einsum("mh,mkh->mk", z, self.head), z @ self.answers.T], 1)
            return self.weight * (p * (self.base_logp - logits.float().log_softmax(-1))).sum(-1).mean()
        return penalty


@torch.no_grad()
def keep_rows(trainer: InstantTrainer, ids: Sequence[int], answers: Tensor, weight: float) -> Keep | None:
    """Keep over `ids` in windows: each position's KEEP_CANDIDATES likeliest tokens and `answers` (a token in
    both counts twice, on both sides of the KL alike)."""
    parts: list[tuple[Captured, Tensor, Tensor]] = []
    for start in range(0, len(ids) - 1, KEEP_WINDOW):
        window = list(ids[start:start + KEEP_WINDOW + 1])
        if len(window) < 2:
            break
        cap = trainer.frozen_pass(Example(tuple(window[:1]), tuple(window[1:])))
        top = cap.logits.topk(min(KEEP_CANDIDATES, cap.logits.shape[-1]), -1).indices  # [W, K]
        logits = torch.cat([cap.logits.gather(1, top), cap.logits[:, answers]], 1)  # [W, K + U]
        parts.append((Captured(cap.x, cap.attn, torch.empty(0), torch.empty(0)), top, logits.log_softmax(-1)))
    if not parts:
        return None
    captured = Captured(torch.cat([c.x for c, _, _ in parts]), torch.cat([c.attn for c, _, _ in parts]),
                        torch.empty(0), torch.empty(0))
    weights = trainer.model.lm_head.weight.detach()
    return Keep(captured, weights[torch.cat([t for _, t, _ in parts])], weights[answers],
                torch.cat([b for _, _, b in parts]), weight)


def consolidate_patterns(model: nn.Module, config: SonaConfig, examples: Sequence[Example],
                         keep_ids: Sequence[int]) -> tuple[TrainableLora, TrainStats]:
    """One LoRA (micro_modules of the last micro_layers, rank `rank`) fitted to every example's answer rows,
    holding the base on `keep_ids` (the float model itself runs the frozen passes: this is the background
    copy, never the instant thread's)."""
    start = time.perf_counter()
    trainer = InstantTrainer(model, dataclasses.replace(config, instant_dtype="float32", micro_rank=config.rank))
    lora = trainer.new_lora()
    if not trainer.fast or not examples:
        raise ValueError("consolidate_patterns needs the instant update's fast path (micro_modules, one layer)")
    caps = [trainer.frozen_pass(e) for e in examples]
    trainer.prefixes.clear()
    captured = Captured(*(torch.cat([getattr(c, f.name) for c in caps]) for f in dataclasses.fields(Captured)))
    targets = torch.tensor([t for e in examples for t in e.target_ids])
    keep = keep_rows(trainer, keep_ids, targets.unique(), config.keep_weight) \
        if config.keep_weight > 0 and len(keep_ids) > 1 else None
    trainer.prefixes.clear()
    steps, first, last = trainer.fit(lora, captured, targets, steps=config.consolidate_steps, keep=keep)
    return lora, TrainStats(steps, first, last, time.perf_counter() - start)

