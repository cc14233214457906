"""Learning from feedback (the seeds' SONA loops): per-session MicroLoRAs, EWC consolidation, distillation.

    from py_engine.learning import Sona, SonaConfig
    sona = Sona.load("tiny-shakespeare", SonaConfig(micro_rank=2), folder="runs/sona")

`config` is ring 0 (stdlib only); the rest is torch and imported on first use.
"""
from __future__ import annotations

from .config import SonaConfig

_LAZY = {"Sona": "sona", "Update": "sona", "Consolidation": "sona", "TrainableLora": "lora", "save_peft": "lora",
         "load_peft": "lora", "fold": "lora", "applied": "lora", "AdapterStore": "store", "Example": "objective",
         "example_from_feedback": "objective", "mean_nll": "objective", "diagonal_fisher": "ewc",
         "train_lora": "train"}

__all__ = ["SonaConfig", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
