"""Read a peft LoRA adapter folder: its config and its A/B matrices per module.

peft saves `base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r] for each adapted linear layer `<module>` (the
base model's own name, e.g. `model.layers.3.mlp.down_proj`), in
adapter_model.safetensors (or adapter_model.bin, read with
weights_only=True). Any other tensor (DoRA magnitudes, LoRA on the
embedding, biases) is refused, so nothing in the file is silently ignored.
"""
from __future__ import annotations

import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..models.safetensors_io import SafetensorsError, SafetensorsFile
from .config import DEFAULT_MAX_RANK, WEIGHT_NAMES, AdapterError, LoraConfig, adapter_file

PREFIX = "base_model.model."
MAX_ADAPTER_BYTES = 8 << 30
EMBEDDING_NAMES = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class LoraModule:
    """One adapted linear layer: delta(x) = scaling * B (A x)."""

    A: Tensor  # [r, in]
    B: Tensor  # [out, r]
    scaling: float

    @property
    def rank(self) -> int:
        return self.A.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    """A whole adapter: module name (the base model's, e.g. model.layers.0.self_attn.q_proj) -> LoraModule."""

    config: LoraConfig
    modules: dict[str, LoraModule]
    # Base weights peft saved beside the LoRA matrices (save_embedding_layers, on by default when a tied LM
    # head is a target): module name -> weight. LoraManager.add checks that they equal the model's own.
    base_weights: dict[str, Tensor] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return self.config.path

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def load_lora(folder: str | Path, max_rank: int = DEFAULT_MAX_RANK, within: Path | None = None) -> LoraAdapter:
    """An adapter folder as float32 CPU tensors, every tensor accounted for and finite; AdapterError
    otherwise. within: the only folder its files may resolve into (a server's --lora-dir)."""
    folder = Path(folder)
    config = LoraConfig.from_dir(folder, max_rank, within)
    tensors = _read_tensors(folder, within)
    pairs: dict[str, dict[str, Tensor]] = {}
    base_weights = {}
    for key, tensor in tensors.items():
        module, which = _split_key(folder, key)
        if which == "base":
            base_weights[module] = tensor
        else:
            pairs.setdefault(module, {})[which] = tensor
    modules = {}
    for name, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterError(f"{folder}: module {name!r} has no {missing}.weight")
        A, B = pair["A"], pair["B"]
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
            raise AdapterError(f"{folder}: module {name!r}: lora_A {list(A.shape)} and lora_B {list(B.shape)} "
                               "are not [r, in] and [out, r]")
        r = A.shape[0]
        if r > max_rank:
            raise AdapterError(f"{folder}: module {name!r} has rank {r}, above the limit of {max_rank} "
                               "(--max-lora-rank / max_lora_rank)")
        if r != config.rank(name):
            raise AdapterError(f"{folder}: module {name!r} has rank {r} but adapter_config.json says "
                               f"{config.rank(name)}")
        modules[name] = LoraModule(A.float().contiguous(), B.float().contiguous(), config.scaling(name, r))
    if not modules:
        raise AdapterError(f"{folder}: the adapter holds no lora_A/lora_B tensors")
    broken = [name for name, m in modules.items() if not (torch.isfinite(m.A).all() and torch.isfinite(m.B).all())]
    if broken:  # NaN or inf once answered every request with "" and finish_reason "stop"
        more = f" and {len(broken) - 3} more" if len(broken) > 3 else ""
        raise AdapterError(f"{folder}: non-finite weights (NaN or inf) in {', '.join(broken[:3])}{more}")
    return LoraAdapter(config, modules, base_weights)


def _read_tensors(folder: Path, within: Path | None = None) -> dict[str, Tensor]:
    for name in WEIGHT_NAMES:
        if not (folder / name).is_file():
            continue
        path = adapter_file(folder, name, within)
        if path.stat().st_size > MAX_ADAPTER_BYTES:
            raise AdapterError(f"{path}: larger than {MAX_ADAPTER_BYTES >> 30} GiB")
        if name.endswith(".safetensors"):
            try:
                f = SafetensorsFile(path)
                return {k: f.get(k).clone() for k in f.keys()}
            except SafetensorsError as e:
                raise AdapterError(str(e)) from None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                state = torch.load(path, map_location="cpu", weights_only=True)
        except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError) as e:
            raise AdapterError(f"{path}: not a readable PyTorch weights file ({type(e).__name__}: {e})") from None
        if not isinstance(state, dict) or not all(isinstance(t, Tensor) for t in state.values()):
            raise AdapterError(f"{path}: expected a dict of tensors")
        return dict(state)
    raise AdapterError(f"{folder}: no adapter weights ({' or '.join(WEIGHT_NAMES)})")


def _split_key(folder: Path, key: str) -> tuple[str, str]:
    """`base_model.model.X.lora_A.weight` -> (X, "A"); anything that is not a LoRA matrix is an error."""
    name = key.removeprefix(PREFIX)
    for which in ("A", "B"):
        suffix = f".lora_{which}.weight"
        if name.endswith(suffix):
            return name[: -len(suffix)], which
    for suffix in (".base_layer.weight", ".weight"):  # a whole embedding or head, saved as peft found it
        module = name.removesuffix(suffix)
        if name.endswith(suffix) and module.rpartition(".")[2] in EMBEDDING_NAMES:
            return module, "base"
    if "lora_embedding" in name:
        raise AdapterError(f"{folder}: {key!r} is LoRA on the embedding; ruvllm applies LoRA to linear layers only")
    if "lora_magnitude_vector" in name:
        raise AdapterError(f"{folder}: {key!r} is a DoRA magnitude vector; DoRA is not supported")
    raise AdapterError(f"{folder}: tensor {key!r} is not a LoRA matrix (lora_A/lora_B); "
                       "ruvllm applies plain LoRA only")
