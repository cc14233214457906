"""The server's LoRA adapters: loaded by name, one batch mixing them and the base model.

Like vLLM's multi-LoRA serving: `ruvllm serve MODEL --lora-modules NAME=PATH ...`
loads adapters at start; a request's `model` names an adapter (or the base);
with `--enable-runtime-lora`, POST /v1/load_lora_adapter and
/v1/unload_lora_adapter change them while serving (paths only under
`--lora-dir`; nothing is fetched).

Every adapter lives in the model's one `LoraManager` (py_engine.adapters)
under an internal key `NAME#LOAD_ID`, so a name unloaded and loaded again is
another adapter: its prefix-cache chain (rooted by the load id,
block_manager.adapter_root) shares no block with the old one's. Each step the
runner gives every token the slot of its sequence's adapter (punica's
gathered shrink/expand, as LoraLinear's masked matmuls).

Unloading never drops a request: the name stops being accepted at once, and
the matrices leave the model once no sequence (running, waiting or
preempted) uses them. All of this runs on the engine's thread, between steps.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from py_engine.adapters.config import AdapterError, parse_named_paths

if TYPE_CHECKING:  # torch is imported when an engine has adapters, not when serve's flags are parsed
    from py_engine.adapters import LoraAdapter

logger = logging.getLogger("ruvllm.server")
DEFAULT_MAX_LORAS = 8
DEFAULT_MAX_LORA_RANK = 64


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    key: str  # the LoraManager's name for it
    load_id: int
    rank: int


class EngineAdapters:
    """The adapters of one engine's model, by public name; touched only on the engine's thread."""

    def __init__(self, model: Any, max_loras: int = DEFAULT_MAX_LORAS, max_rank: int = DEFAULT_MAX_LORA_RANK) -> None:
        from py_engine.adapters import LoraManager

        self.manager = LoraManager(model, max_loras=max_loras, max_rank=max_rank)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.by_name: dict[str, LoadedAdapter] = {}
        self.retiring: dict[str, LoadedAdapter] = {}  # key -> adapter unloaded while sequences still use it
        self._ids = itertools.count(1)
        self.on_change: Any = None  # called as on_change(command, key, ...) when the model's adapters change

    def add(self, name: str, adapter: "LoraAdapter | str | Path") -> LoadedAdapter:
        if name in self.by_name:
            raise AdapterError(f"an adapter named {name!r} is already loaded")
        load_id = next(self._ids)
        key = f"{name}#{load_id}"
        if len(self.manager.slots) >= self.max_loras:
            raise AdapterError(f"{len(self.manager.slots)} adapters are loaded (some may be finishing their "
                               f"requests), the limit (--max-loras) is {self.max_loras}")
        self.manager.add(key, adapter)
        if self.on_change is not None:  # tensor parallelism: the workers load it too, cut to their ranks
            self.on_change("adapter_add", key, adapter)
        rank = self.manager.adapters[key].max_rank
        loaded = self.by_name[name] = LoadedAdapter(name, key, load_id, rank)
        logger.info("LoRA adapter %s loaded (rank %d)", name, rank)
        return loaded

    def retire(self, name: str) -> LoadedAdapter:
        """Stop accepting requests for `name`; its matrices go once release() finds it unused."""
        loaded = self.by_name.pop(name, None)
        if loaded is None:
            raise AdapterError(f"no adapter named {name!r} is loaded")
        self.retiring[loaded.key] = loaded
        return loaded

    def release(self, in_use: Iterable[str | None]) -> None:
        """Remove retired adapters no sequence uses any more."""
        if not self.retiring:
            return
        used = set(in_use)
        for key in [k for k in self.retiring if k not in used]:
            self.manager.remove(key)
            if self.on_change is not None:
                self.on_change("adapter_remove", key)
            logger.info("LoRA adapter %s unloaded", self.retiring.pop(key).name)

    def get(self, name: str) -> LoadedAdapter:
        loaded = self.by_name.get(name)
        if loaded is None:
            raise AdapterError(f"no adapter named {name!r} is loaded")
        return loaded

    def set_mix(self, seq_keys: list[str | None], tokens_per_seq: list[int], sampling: list[int]) -> None:
        """Slots for the next forward: seq_keys[i] is sequence i's adapter key (None: base), run over
        tokens_per_seq[i] tokens; sampling: the sequences whose last token reaches the LM head."""
        slots = [self.manager.slot(k) for k in seq_keys]
        if all(s == slots[0] for s in slots):  # one adapter (or none) for the whole batch: no per-row mask
            key = seq_keys[0] if slots else None
            self.manager.set_adapter_mix(key)
            return
        import torch

        per_seq = torch.tensor(slots)
        rows = torch.repeat_interleave(per_seq, torch.tensor(tokens_per_seq))  # [N] slot of each token
        self.manager.set_adapter_mix(indices=rows, head_indices=per_seq[sampling] if sampling else None)


def parse_lora_modules(specs: list[str] | None) -> dict[str, str]:
    """`--lora-modules NAME=PATH ...` (the flag repeatable, several pairs each) as name -> path."""
    return parse_named_paths([s for group in specs or [] for s in (group if isinstance(group, list) else [group])],
                             "--lora-modules")


def confined_path(lora_dir: Path, lora_path: str) -> Path:
    """lora_path (absolute or relative to lora_dir) resolved, refused unless it lies inside lora_dir."""
    if len(lora_path) > 4096 or "\x00" in lora_path:
        raise AdapterError("lora_path is not a usable path")
    root = lora_dir.resolve()
    path = (root / lora_path).resolve()
    if path != root and root not in path.parents:
        raise AdapterError(f"lora_path must be inside the server's --lora-dir; {lora_path!r} is not")
    return path
