"""LoRA adapters from peft checkpoints, applied unmerged (many per model) or merged.

    from py_engine.adapters import LoraManager, load_lora, merge_lora
    manager = LoraManager(model)                      # model.lora
    manager.add("poems", "path/to/peft-adapter")
    with manager.using("poems"):
        logits = model(ids, positions, kv)

`config` (adapter_config.json, AdapterError, NAME=PATH parsing) is ring 0
(stdlib only); the rest is torch and is imported on first use, so importing
this package costs nothing where torch is absent.
"""
from __future__ import annotations

from .config import AdapterError, LoraConfig, parse_named_paths

_LAZY = {"LoraAdapter": "checkpoint", "LoraModule": "checkpoint", "load_lora": "checkpoint",
         "AdapterMix": "layer", "LoraLinear": "layer", "LoraManager": "manager",
         "merge_lora": "merge", "write_merged": "merge"}

__all__ = ["AdapterError", "LoraConfig", "parse_named_paths", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
