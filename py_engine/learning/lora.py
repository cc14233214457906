"""A trainable LoRA over a plain (float, unfused) CausalLM, and its peft folder.

    lora = TrainableLora.for_model(model, ("o_proj", "down_proj"), layers=2, rank=2)
    with lora.attached(model):          # forward hooks: y = W x + scaling * B (A x)
        loss = ...; loss.backward()
    lora.save_peft("DIR/adapters/sona-v1", base="tiny-shakespeare")
    lora.adapter()                      # {module: (A [r, in], B [out, r], scaling)}, float32 on the CPU

Module names are the base model's own (`model.layers.5.mlp.down_proj`),
which are peft's and the adapters loader's too. Initialised as peft does
(A Kaiming-uniform, B zero: the adapter starts as the identity), from a
seeded generator.
"""
from __future__ import annotations

import json
import math
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PEFT_PREFIX = "base_model.model."


def target_names(model: nn.Module, modules: Sequence[str], layers: int) -> list[str]:
    """Full names of the projections `modules` in the last `layers` decoder layers (0: all)."""
    count = len(model.model.layers)
    first = 0 if layers == 0 else max(0, count - layers)
    names = []
    for i in range(first, count):
        for name, module in model.model.layers[i].named_modules():
            if name.rsplit(".", 1)[-1] in modules:
                if not isinstance(module, nn.Linear):
                    raise ValueError(f"model.layers.{i}.{name} is a {type(module).__name__}, not a float Linear: "
                                     "train on the model loaded without optimize / quantization")
                names.append(f"model.layers.{i}.{name}")
    if not names:
        raise ValueError(f"no {', '.join(modules)} in the model's layers")
    return names


class TrainableLora(nn.Module):
    """LoRA matrices per module: A [r, in], B [out, r], delta(x) = scaling * B (A x)."""

    def __init__(self, shapes: dict[str, tuple[int, int]], rank: int, alpha: float | None = None,
                 seed: int = 0) -> None:
        super().__init__()
        self.names = list(shapes)
        self.rank, self.alpha = rank, float(alpha if alpha is not None else rank)
        self.scaling = self.alpha / rank
        gen = torch.Generator().manual_seed(seed)
        self.A, self.B = nn.ParameterList(), nn.ParameterList()
        for name in self.names:
            out_f, in_f = shapes[name]
            bound = 1 / math.sqrt(in_f)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and peft
            self.A.append(nn.Parameter(torch.empty(rank, in_f).uniform_(-bound, bound, generator=gen)))
            self.B.append(nn.Parameter(torch.zeros(out_f, rank)))

    @classmethod
    def for_model(cls, model: nn.Module, modules: Sequence[str], layers: int, rank: int,
                  alpha: float | None = None, seed: int = 0) -> "TrainableLora":
        names = target_names(model, modules, layers)
        shapes = {n: tuple(model.get_submodule(n).weight.shape) for n in names}
        return cls(shapes, rank, alpha, seed)

    def delta(self, i: int) -> Tensor:
        """scaling * B A: [out, in]."""
        return (self.B[i] * self.scaling) @ self.A[i]

    def attached(self, model: nn.Module) -> AbstractContextManager[None]:
        """Model forwards inside add this LoRA's deltas (forward hooks, removed on exit); gradients reach A and B."""
        return applied(model, {n: (self.A[i], self.B[i], self.scaling) for i, n in enumerate(self.names)})

    def adapter(self) -> dict[str, tuple[Tensor, Tensor, float]]:
        """{module: (A, B, scaling)}: detached float32 CPU copies (what the serving path loads)."""
        return {n: (self.A[i].detach().float().cpu().clone(), self.B[i].detach().float().cpu().clone(),
                    self.scaling) for i, n in enumerate(self.names)}

    def load_adapter(self, modules: dict[str, tuple[Tensor, Tensor, float]]) -> None:
        """Continue from saved matrices (same names and rank); the scaling is folded into B."""
        with torch.no_grad():
            for i, name in enumerate(self.names):
                A, B, scaling = modules[name]
                self.A[i].copy_(A)
                self.B[i].copy_(B * (scaling / self.scaling))

    def save_peft(self, folder: str | Path, base: str | None = None) -> Path:
        return save_peft(folder, self.adapter(), base)


@contextmanager
def applied(model: nn.Module, modules: dict[str, tuple[Tensor, Tensor, float]] | None) -> Iterator[None]:
    """Forwards inside add scaling * B(A x) for each of `modules` ({name: (A, B, scaling)}; None: nothing).
    A and B are read at each forward, so a LoRA trained in place (TrainableLora.attached) uses it too."""
    handles = []
    for name, (A, B, scaling) in (modules or {}).items():
        def hook(module: nn.Module, args: tuple, out: Tensor, A: Tensor = A, B: Tensor = B,
                 scaling: float = scaling) -> Tensor:
            x = args[0]
            return out + F.linear(F.linear(x, A.to(x.dtype)), B.to(x.dtype)) * scaling
        handles.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def save_peft(folder: str | Path, modules: dict[str, tuple[Tensor, Tensor, float]], base: str | None = None) -> Path:
    """Write {module: (A, B, scaling)} as a peft LoRA folder (adapter_config.json + adapter_model.safetensors).

    Ranks may differ between modules (rank_pattern); each module's scaling becomes its lora_alpha, so
    alpha / r gives it back. target_modules lists full module names, which peft matches exactly."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ranks = {n: A.shape[0] for n, (A, _, _) in modules.items()}
    r = max(ranks.values())
    alphas = {n: s * ranks[n] for n, (_, _, s) in modules.items()}
    alpha = alphas[next(iter(modules))]
    tensors = {}
    for name, (A, B, _) in modules.items():
        tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = A.contiguous().float()
        tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = B.contiguous().float()
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": r,
              "lora_alpha": alpha, "target_modules": sorted(modules), "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
              "init_lora_weights": True,
              "rank_pattern": {n: k for n, k in ranks.items() if k != r},
              "alpha_pattern": {n: a for n, a in alphas.items() if a != alpha}}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


def load_peft(folder: str | Path) -> dict[str, tuple[Tensor, Tensor, float]]:
    """A folder save_peft wrote (or any plain peft LoRA of ours), as {module: (A, B, scaling)}."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    out = {}
    for key in tensors:
        if key.endswith(".lora_A.weight"):
            name = key[len(PEFT_PREFIX):-len(".lora_A.weight")]
            A, B = tensors[key], tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"]
            r = config.get("rank_pattern", {}).get(name, config["r"])
            alpha = config.get("alpha_pattern", {}).get(name, config["lora_alpha"])
            out[name] = (A, B, alpha / r)
    return out


def fold(parts: Sequence[tuple[float, dict[str, tuple[Tensor, Tensor, float]]]]
         ) -> dict[str, tuple[Tensor, Tensor, float]]:
    """One adapter whose delta is sum of weight * delta of each part: their A rows and (weighted, scaled)
    B columns side by side, exactly; scaling 1. A module a part lacks gets zero columns there."""
    names = sorted({n for _, m in parts for n in m})
    out = {}
    for name in names:
        As, Bs = [], []
        shape = next(m[name] for _, m in parts if name in m)
        for weight, modules in parts:
            if name in modules:
                A, B, s = modules[name]
                As.append(A.float())
                Bs.append(B.float() * (s * weight))
            else:
                As.append(torch.zeros_like(shape[0]))
                Bs.append(torch.zeros_like(shape[1]))
        out[name] = (torch.cat(As, 0), torch.cat(Bs, 1), 1.0)
    return out


def to_lora_adapter(modules: dict[str, tuple[Tensor, Tensor, float]], name: str, base: str | None = None) -> Any:
    """{module: (A, B, scaling)} as the adapters package's LoraAdapter (what LoraManager.add takes)."""
    from py_engine.adapters import LoraAdapter, LoraConfig, LoraModule

    ranks = {n: A.shape[0] for n, (A, _, _) in modules.items()}
    r = max(ranks.values())
    config = LoraConfig(path=name, r=r, lora_alpha=float(r), target_modules=tuple(sorted(modules)),
                        base_model_name_or_path=base, rank_pattern={n: k for n, k in ranks.items() if k != r})
    return LoraAdapter(config, {n: LoraModule(A.float().contiguous(), B.float().contiguous(), float(s))
                                for n, (A, B, s) in modules.items()})
