"""A peft LoRA adapter's adapter_config.json, parsed once (ring 0: stdlib only).

    cfg = LoraConfig.from_dir("path/to/adapter", max_rank=64)
    cfg.scaling("model.layers.0.self_attn.q_proj", r=8)   # lora_alpha / r, or / sqrt(r) with rslora

What ruvllm applies is peft's LoRA on linear layers with `bias="none"`:
y = W x + b + scaling * B (A x). Anything that would change more than that
(DoRA's magnitude vectors, `modules_to_save` copies of whole modules such as
the embedding, trained biases, new token rows, another peft method) is
refused with one `AdapterError` that says what and why, rather than run
silently wrong.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
MAX_CONFIG_BYTES = 1 << 20
DEFAULT_MAX_RANK = 256  # the Python API's bound; the server's --max-lora-rank is smaller
# Fields that, set to anything but these values, ask for more than LoRA deltas on linear layers.
_REFUSED = {
    "use_dora": (False, None, "DoRA (use_dora) rescales each weight column by a learned magnitude"),
    "lora_bias": (False, None, "lora_bias trains a bias for lora_B"),
    "fan_in_fan_out": (False, None, "fan_in_fan_out is for GPT-2 Conv1D layers, which Llama-family models lack"),
    "trainable_token_indices": (None, "trainable_token_indices retrains embedding rows"),
    "layer_replication": (None, "layer_replication duplicates decoder layers"),
    "target_parameters": (None, [], "target_parameters adapts raw parameters (MoE experts), not linear layers"),
    "alora_invocation_tokens": (None, "activated LoRA (alora_invocation_tokens) switches on mid-sequence"),
    "use_qalora": (False, None, "QA-LoRA pools its input in groups"),
    "use_bdlora": (None, False, "block-diagonal LoRA (use_bdlora) is another layout"),
}


class AdapterError(ValueError):
    """An adapter that cannot be applied as it is: one message that names the file and what is wrong."""


def adapter_file(folder: Path, name: str, within: Path | None = None) -> Path:
    """folder/name, resolved; with `within` (a server's --lora-dir) refused unless the file itself,
    links followed, lies inside it: resolving only the folder let a linked adapter_config.json be
    read from anywhere."""
    path = folder / name
    if within is None:
        return path
    root, resolved = within.resolve(), path.resolve()
    if root not in resolved.parents:
        raise AdapterError(f"{folder.name}/{name} links outside the folder adapters may be loaded from; "
                           "refused (copy the file in instead of linking it)")
    return resolved


@dataclass(frozen=True)
class LoraConfig:
    """The fields of peft's LoraConfig that decide the arithmetic (peft's names)."""

    path: str
    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()
    base_model_name_or_path: str | None = None
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise AdapterError(f"{self.path}: r must be a positive integer, got {self.r!r}")
        if not isinstance(self.lora_alpha, (int, float)) or isinstance(self.lora_alpha, bool) \
                or not math.isfinite(self.lora_alpha):
            raise AdapterError(f"{self.path}: lora_alpha must be a finite number, got {self.lora_alpha!r}")

    @classmethod
    def from_dir(cls, folder: str | Path, max_rank: int = DEFAULT_MAX_RANK, within: Path | None = None
                 ) -> "LoraConfig":
        """within: the only folder the config file may resolve into (see adapter_file)."""
        folder = Path(folder)
        path = adapter_file(folder, CONFIG_NAME, within)
        if not folder.is_dir():
            raise AdapterError(f"{folder}: no such adapter folder")
        if not path.is_file():
            raise AdapterError(f"{folder}: no {CONFIG_NAME} (a peft adapter folder has it beside "
                               f"{' or '.join(WEIGHT_NAMES)})")
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise AdapterError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise AdapterError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise AdapterError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, str(folder), max_rank)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], path: str = "<adapter>",
                  max_rank: int = DEFAULT_MAX_RANK) -> "LoraConfig":
        peft_type = raw.get("peft_type", "LORA")
        if peft_type != "LORA":
            hint = " (load X-LoRA with --xlora / LLM(xlora=...))" if peft_type == "XLORA" else ""
            raise AdapterError(f"{path}: peft_type {peft_type!r} is not a LoRA adapter{hint}")
        _refuse_extras(raw, path)
        cfg = cls(path=path, r=raw.get("r", 8), lora_alpha=raw.get("lora_alpha", 8),
                  use_rslora=bool(raw.get("use_rslora", False)),
                  target_modules=_targets(raw.get("target_modules"), path),
                  base_model_name_or_path=raw.get("base_model_name_or_path"),
                  rank_pattern=_pattern(raw, "rank_pattern", path), alpha_pattern=_pattern(raw, "alpha_pattern", path))
        top = max([cfg.r, *cfg.rank_pattern.values()])
        if top > max_rank:
            raise AdapterError(f"{path}: rank {top} is above the limit of {max_rank} (--max-lora-rank / max_lora_rank)")
        return cfg

    def rank(self, module: str) -> int:
        """The rank peft gave this module (rank_pattern first, as peft's get_pattern_key matches)."""
        return self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)

    def scaling(self, module: str, r: int) -> float:
        """peft's `scaling[adapter]`: lora_alpha / r, or lora_alpha / sqrt(r) with rslora."""
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _refuse_extras(raw: Mapping[str, Any], path: str) -> None:
    for key, (*allowed, why) in _REFUSED.items():
        if key in raw and raw[key] not in allowed:
            raise AdapterError(f"{path}: {why}; ruvllm applies plain LoRA only ({key}={raw[key]!r})")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias={raw['bias']!r} trains the base model's biases; ruvllm applies "
                           "adapters with bias='none' only")
    saved = raw.get("modules_to_save")
    if saved:
        what = "the embedding" if any("embed" in str(m) or "wte" in str(m) for m in saved) else "whole modules"
        raise AdapterError(f"{path}: modules_to_save={list(saved)!r} stores full copies of {what}, which a LoRA "
                           "delta cannot express; merge the adapter with peft (merge_and_unload) and load the result "
                           "as a model instead")


def _targets(value: Any, path: str) -> tuple[str, ...] | str:
    if value is None:
        return ()
    if isinstance(value, str):  # peft: a regex matched against the whole module name
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise AdapterError(f"{path}: target_modules must be a list of names or a regex, got {value!r}")


def _pattern(raw: Mapping[str, Any], key: str, path: str) -> dict:
    value = raw.get(key) or {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in value.items()):
        raise AdapterError(f"{path}: {key} must map module names to numbers, got {value!r}")
    if key == "rank_pattern" and any(not isinstance(v, int) or v < 1 for v in value.values()):
        raise AdapterError(f"{path}: rank_pattern ranks must be positive integers, got {value!r}")
    return dict(value)


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str:
    """The first pattern that matches the end of a module name, dot-aligned (peft's rule)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def parse_named_paths(specs: list[str] | tuple[str, ...], flag: str = "--lora") -> dict[str, str]:
    """CLI `NAME=PATH` pairs as a dict; a bad or repeated name is one error naming the flag."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name = name.strip()
        if not sep or not name or not path:
            raise AdapterError(f"{flag} takes NAME=PATH, got {spec!r}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}", name):
            raise AdapterError(f"{flag}: adapter name {name!r} must be 1-128 letters, digits or ._:/- ")
        if name in out:
            raise AdapterError(f"{flag}: adapter name {name!r} is given twice")
        out[name] = path
    return out


def add_lora_options(parser, adapter: bool = True) -> None:
    """`--lora NAME=PATH` (repeatable) and `--adapter NAME` (which one applies), for any command."""
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                        help="load a peft LoRA adapter folder under NAME (repeatable)")
    if adapter:
        parser.add_argument("--adapter", metavar="NAME", help="apply the --lora adapter NAME (default: the base model)")
    parser.add_argument("--max-lora-rank", type=int, default=DEFAULT_MAX_RANK, metavar="R",
                        help=f"refuse adapters of rank above R (default {DEFAULT_MAX_RANK})")


def lora_from_args(args) -> tuple[dict[str, str], str | None]:
    """(name -> path, the adapter to apply) from add_lora_options' flags; one clear error if they disagree."""
    loras = parse_named_paths(getattr(args, "lora", None) or [])
    adapter = getattr(args, "adapter", None)
    if adapter is not None and adapter not in loras:
        raise AdapterError(f"--adapter {adapter!r} names no --lora adapter (given: {', '.join(loras) or 'none'})")
    if not 1 <= getattr(args, "max_lora_rank", DEFAULT_MAX_RANK) <= 4096:
        raise AdapterError("--max-lora-rank must be in [1, 4096]")
    return loras, adapter
