"""The engine: requests in, one batched forward pass per step over a paged KV cache, outputs out.

    config.py        EngineConfig: every setting, frozen, with the CLI flags (add_cli_args / from_cli_args)
    llm_engine.py    LLMEngine: add_request / step / abort (the loop: schedule, run, sample)
    async_engine.py  AsyncEngine: the loop in a thread of its own, requests as async iterators
    scheduler.py     continuous batching: which sequences compute how many tokens this step
    block_manager.py KV blocks: allocation, reference counts, prefix caching, the cold pool's ids
    sequence.py      one sequence: its tokens and how far the KV cache has caught up
    model_runner.py  one forward pass of the flattened batch
    sampler.py       batched sampling with the reference sampler's semantics
    outputs.py       what the engine hands back: deltas, errors, counters
    kv_cache.py      the paged KV cache's tensors and their size from a memory budget
    cuda_graphs.py   decode steps captured as CUDA graphs
    lora.py          LoRA adapters in slots, one batch mixing them
    attention/       the paged-attention interface, its backends and the picker

Nothing here imports the HTTP side (api/) or learning/. `LLMEngine`,
`EngineConfig` and `AsyncEngine` are importable from this package; importing the package loads
neither torch nor them until one is asked for (the scheduler and block
manager import without torch).
"""
from __future__ import annotations

from typing import Any

__all__ = ["AsyncEngine", "EngineConfig", "LLMEngine"]


def __getattr__(name: str) -> Any:
    if name == "LLMEngine":
        from native_server.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "EngineConfig":
        from native_server.engine.config import EngineConfig
        return EngineConfig
    if name == "AsyncEngine":
        from native_server.engine.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
