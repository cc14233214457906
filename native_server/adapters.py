"""LoRA adapters in the serving engine: loaded by name, swapped between steps, chosen per request.

    engine.adapters.set("sona/alice", lora_adapter)   # on the engine thread (AsyncEngine.call_between_steps)
    engine.add_request(rid, ids, params, adapter="sona/alice")

Each step, every token of the flattened batch gets its sequence's adapter
slot (-1 for the base) through the model's LoraManager (py_engine.adapters),
so requests with different adapters, or none, share one forward pass.
Replacing an adapter bumps its version, and a sequence's prefix-cache hashes
are salted with (name, version) at admission: KV computed under one adapter
(or an older version of it) is never reused under another. A running request
whose adapter is replaced goes on with the new weights; one whose adapter is
removed (or that names one never loaded) runs on the base, with a warning.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

logger = logging.getLogger("ruvllm.server")

MAX_ADAPTER_RANK = 256


class EngineAdapters:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.manager: Any = None  # py_engine.adapters.LoraManager, made at the first adapter
        self.versions: dict[str, int] = {}

    def set(self, name: str, adapter: Any) -> None:
        """Load (or replace) adapter `name`; None removes it. Call between steps, on the engine thread."""
        from py_engine.adapters import LoraManager

        if self.manager is None:
            self.manager = getattr(self.model, "lora", None) or LoraManager(self.model, max_rank=MAX_ADAPTER_RANK)
        if name in self.manager.slots:
            self.manager.remove(name)
        if adapter is None:
            self.versions.pop(name, None)
            return
        self.manager.add(name, adapter)
        self.versions[name] = self.versions.get(name, 0) + 1

    def resolve(self, name: str | None) -> tuple[str | None, int]:
        """(the adapter a new request runs with, its prefix-cache salt); an unknown name is the base."""
        if name is None:
            return None, 0
        version = self.versions.get(name)
        if version is None:
            logger.warning("adapter %r is not loaded; the request runs on the base model", name)
            return None, 0
        return name, hash((name, version))

    def active(self, out: Any) -> bool:
        return self.manager is not None and any(s.adapter is not None for s in out.seqs)

    @contextmanager
    def mix(self, out: Any) -> Iterator[None]:
        """The step's forward with each token's adapter: slots per sequence, repeated over its new tokens."""
        slots = [self.manager.slots.get(s.adapter, -1) if s.adapter is not None else -1 for s in out.seqs]
        rows = torch.repeat_interleave(torch.tensor(slots, dtype=torch.long),
                                       torch.tensor(out.num_new_tokens, dtype=torch.long))  # [N]
        self.manager.set_adapter_mix(indices=rows)
        try:
            yield
        finally:
            self.manager.set_adapter_mix(None)
