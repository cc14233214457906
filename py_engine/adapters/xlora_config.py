"""An X-LoRA folder's adapter_config.json (peft's XLoraConfig), parsed once (ring 0: stdlib only).

    cfg = XLoraConfig.from_dir("path/to/xlora")      # what XLoraModel.save_pretrained wrote
    cfg.experts                                      # (("0", "../comedies"), ...): name -> saved path

X-LoRA (Buehler & Buehler, 2024) mixes frozen LoRA experts per token: a scaling pass of
the model yields hidden states, a small classifier turns each token's final hidden state
into a weight per expert (and per LoRA layer when `layerwise_scalings`), and the real
pass applies every expert's delta times its weight. The fields are peft's; the mixing is
peft's ("Additive": a weighted sum of the experts' deltas). The seeds also name
"Concatenate" and "Gated" mixing modes: no reference implementation of either exists
(not in peft, not in mistral.rs, not in the X-LoRA paper's code), so ruvllm has neither.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .config import CONFIG_NAME, MAX_CONFIG_BYTES, AdapterError

__all__ = ["XLoraConfig", "is_xlora_dir"]

MAX_EXPERTS = 64
MAX_DEPTH = 16
MAX_CLASSIFIER_WIDTH = 1 << 16


@dataclass(frozen=True)
class XLoraConfig:
    """peft's XLoraConfig fields that decide the arithmetic (peft's names and defaults)."""

    path: str
    hidden_size: int
    experts: tuple[tuple[str, str], ...]  # peft's `adapters`, in order: expert i is peft's adapter "i"
    enable_softmax: bool = True
    enable_softmax_topk: bool = False
    layerwise_scalings: bool = False
    xlora_depth: int = 1
    xlora_size: int = 2048
    softmax_temperature: float = 1.0
    top_k_lora: int | None = None
    scaling_pass_value: float = 0.0
    global_scaling_weight: float = 1.0

    def __post_init__(self) -> None:
        where = self.path
        if not _int(self.hidden_size) or self.hidden_size < 1:
            raise AdapterError(f"{where}: hidden_size must be a positive integer, got {self.hidden_size!r}")
        if not 1 <= len(self.experts) <= MAX_EXPERTS:
            raise AdapterError(f"{where}: `adapters` must name 1 to {MAX_EXPERTS} LoRA experts, got {len(self.experts)}")
        if not _int(self.xlora_depth) or not 1 <= self.xlora_depth <= MAX_DEPTH:
            raise AdapterError(f"{where}: xlora_depth must be 1 to {MAX_DEPTH}, got {self.xlora_depth!r}")
        if not _int(self.xlora_size) or not 1 <= self.xlora_size <= MAX_CLASSIFIER_WIDTH:
            raise AdapterError(f"{where}: xlora_size must be 1 to {MAX_CLASSIFIER_WIDTH}, got {self.xlora_size!r}")
        if not _number(self.softmax_temperature) or not self.softmax_temperature > 0:
            raise AdapterError(f"{where}: softmax_temperature must be a positive number, "
                               f"got {self.softmax_temperature!r}")
        k = self.top_k_lora
        if k is not None and (not _int(k) or not 1 <= k <= len(self.experts)):
            raise AdapterError(f"{where}: top_k_lora must be 1 to the number of experts ({len(self.experts)}), "
                               f"got {k!r}")
        for name in ("scaling_pass_value", "global_scaling_weight"):
            if not _number(getattr(self, name)):
                raise AdapterError(f"{where}: {name} must be a finite number, got {getattr(self, name)!r}")
        for name in ("enable_softmax", "enable_softmax_topk", "layerwise_scalings"):
            if not isinstance(getattr(self, name), bool):
                raise AdapterError(f"{where}: {name} must be true or false, got {getattr(self, name)!r}")

    @property
    def expert_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.experts)

    @property
    def expert_labels(self) -> tuple[str, ...]:
        """What to call each expert: the last part of its saved path ("../comedies" -> "comedies"), since
        peft must name them "0", "1", ...; the names themselves where those parts are empty or repeat."""
        labels = tuple(Path(saved.rstrip("/\\")).name for _, saved in self.experts)
        return labels if all(labels) and len(set(labels)) == len(labels) else self.expert_names

    @classmethod
    def from_dir(cls, folder: str | Path) -> "XLoraConfig":
        path = Path(folder) / CONFIG_NAME
        if not path.is_file():
            raise AdapterError(f"{folder}: no {CONFIG_NAME} (not a peft X-LoRA folder)")
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise AdapterError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise AdapterError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, str(folder))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], path: str = "<xlora>") -> "XLoraConfig":
        if not isinstance(raw, Mapping):
            raise AdapterError(f"{path}: {CONFIG_NAME} must hold a JSON object")
        if raw.get("peft_type") != "XLORA":
            raise AdapterError(f"{path}: peft_type is {raw.get('peft_type')!r}, not 'XLORA' "
                               "(a plain LoRA adapter goes to --lora)")
        adapters = raw.get("adapters")
        if not isinstance(adapters, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in adapters.items()):
            raise AdapterError(f"{path}: `adapters` must map expert names to adapter paths")
        fields = {k: raw[k] for k in ("hidden_size", "enable_softmax", "enable_softmax_topk", "layerwise_scalings",
                                       "xlora_depth", "xlora_size", "softmax_temperature", "top_k_lora",
                                       "scaling_pass_value", "global_scaling_weight") if k in raw}
        return cls(path=path, experts=tuple(adapters.items()), **fields)


def is_xlora_dir(folder: str | Path) -> bool:
    """Whether a folder holds an X-LoRA config (peft_type XLORA); False for anything unreadable."""
    try:
        raw = json.loads((Path(folder) / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(raw, dict) and raw.get("peft_type") == "XLORA"


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def add_xlora_options(parser) -> None:
    """`--xlora DIR` and `--xlora-non-granular K`, for any command that loads a model."""
    parser.add_argument("--xlora", metavar="DIR", help="apply a peft X-LoRA folder (XLoraModel.save_pretrained's) "
                        "to every token: a learned per-token mix of its LoRA experts")
    parser.add_argument("--xlora-non-granular", type=int, metavar="K",
                        help="X-LoRA: compute scalings for the first K forward calls only, then reuse the last "
                             "(mistral.rs's tgt_non_granular_index; one pass per token after that)")


def xlora_from_args(args) -> tuple[str | None, int | None]:
    """(folder, non-granular K) from add_xlora_options' flags; AdapterError when they do not fit together."""
    folder, k = getattr(args, "xlora", None), getattr(args, "xlora_non_granular", None)
    if k is not None and folder is None:
        raise AdapterError("--xlora-non-granular applies to an --xlora model; no --xlora was given")
    if k is not None and not 1 <= k <= 1 << 20:
        raise AdapterError(f"--xlora-non-granular must be a positive number of forward calls, got {k}")
    if folder is not None and getattr(args, "lora", None):
        raise AdapterError("--xlora applies its own LoRA experts to every token: it cannot be combined with --lora")
    return folder, k
