"""Elastic weight consolidation: keep the weights that matter for the base model's own text near it.

The penalty on a LoRA is lambda * sum over its modules of sum(F * dW^2), with
dW = scaling * B A the change it makes to a weight and F that weight's
diagonal Fisher information under the base model (Kirkpatrick et al., 2017).
F is estimated on the base's own validation text: the squared gradient of the
mean NLL of each `window`-token slice, averaged over the slices (an
empirical Fisher per slice rather than per token: one backward pass a slice),
then divided by its mean over every entry, so lambda means the same on any
model and any text length.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .lora import TrainableLora


def diagonal_fisher(model: nn.Module, names: Sequence[str], ids: Sequence[int], window: int = 128,
                    progress: Callable[[int, int], None] | None = None) -> dict[str, Tensor]:
    """{module: F [out, in]} for the weights of `names`, normalised to mean 1."""
    weights = {n: model.get_submodule(n).weight for n in names}
    sums = {n: torch.zeros_like(w, dtype=torch.float32) for n, w in weights.items()}
    tokens = torch.tensor(list(ids), dtype=torch.long)
    starts = list(range(0, max(len(tokens) - 1, 0), window))
    if not starts:
        raise ValueError(f"the Fisher needs at least 2 tokens of text, got {len(tokens)}")
    device = next(model.parameters()).device
    saved = {n: w.requires_grad for n, w in weights.items()}
    try:
        for w in weights.values():
            w.requires_grad_(True)
        with torch.enable_grad():
            for k, start in enumerate(starts):
                chunk = tokens[start:start + window + 1].to(device)[None]  # [1, <= window + 1]
                positions = torch.arange(chunk.shape[1] - 1, device=device)[None]
                logits = model(chunk[:, :-1], positions)
                loss = F.cross_entropy(logits[0], chunk[0, 1:])
                grads = torch.autograd.grad(loss, list(weights.values()))
                for n, g in zip(weights, grads):
                    sums[n] += g.float() ** 2
                if progress is not None:
                    progress(k + 1, len(starts))
    finally:
        for n, w in weights.items():
            w.requires_grad_(saved[n])
    mean = sum(float(s.sum()) for s in sums.values()) / sum(s.numel() for s in sums.values())  # over every entry
    return {n: s / max(mean, 1e-30) for n, s in sums.items()}


def ewc_penalty(lora: TrainableLora, fisher: dict[str, Tensor]) -> Tensor:
    """sum over modules of sum(F * (scaling B A)^2); modules without a Fisher are not penalised."""
    total = torch.zeros(())
    for i, name in enumerate(lora.names):
        if name in fisher:
            total = total + (fisher[name] * lora.delta(i) ** 2).sum()
    return total


def save_fisher(path: Path, fisher: dict[str, Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in fisher.items()}, str(path))


def load_fisher(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))
