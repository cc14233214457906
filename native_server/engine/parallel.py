"""The engine over N tensor-parallel ranks (`LLMEngine(..., tensor_parallel_size=N)`, `serve --tensor-parallel-size N`).

Rank 0 is the engine: requests, the scheduler, the block manager, sampling
and detokenizing all stay there, as at N = 1. Ranks 1..N-1 (py_engine's
launch.py starts them) each hold a shard of the model (py_engine/parallel)
and a paged KV cache of the same number of blocks over their own KV heads;
they are told everything they do:
- at start-up, after every rank has loaded and sharded its model (one
  agreement: an error on any rank is raised on rank 0), the cache's
  geometry (block counts, dtype), which rank 0 sized for itself: its shard
  has the most KV heads when they split unevenly, so its budget binds;
- each step, the plan (model_runner.StepPlan: token ids, positions' start,
  block tables, block copies and demotions, each sequence's adapter),
  broadcast before rank 0 runs it; every rank then runs the same layers and
  meets at each all-reduce, and only rank 0 computes logits;
- each change of adapters (loaded, or removed once unused), as
  EngineAdapters makes it: slots are given in the same order everywhere.
A worker that dies breaks rank 0's next collective: the step raises, and
the server reports the engine dead (/health 503) as for any engine failure.
CUDA graphs and X-LoRA are off or refused here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from native_server.engine.attention import backend_for
from native_server.engine.kv_cache import PagedKVCache
from native_server.engine.lora import EngineAdapters
from native_server.engine.model_runner import ModelRunner, StepPlan
from py_engine.models.kv_quant import KVQuantConfig
from py_engine.parallel.backend import agreed, load_shard
from py_engine.parallel.comm import TensorParallelGroup
from py_engine.parallel.launch import Workers, start_workers

logger = logging.getLogger("ruvllm.server")
WORKER = "native_server.engine.parallel:EngineWorker"


@dataclass(frozen=True)
class ShardOptions:
    """What every rank loads the same way (picklable: it goes to the workers)."""

    path: str
    quantization: Any
    dtype: str
    optimize: bool
    lora_modules: dict
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    attention_backend: str


@dataclass(frozen=True)
class CacheGeometry:
    num_blocks: int
    block_size: int
    dtype: torch.dtype
    quant: KVQuantConfig | None
    num_cold_blocks: int


def _load(group: TensorParallelGroup, options: ShardOptions) -> tuple[Any, Any, Any, EngineAdapters | None]:
    model, config, report = load_shard(group, options.path, options.quantization, options.dtype, options.optimize)
    adapters = None
    if options.lora_modules or options.enable_lora:
        adapters = EngineAdapters(model, options.max_loras, options.max_lora_rank)
        for name, lora_path in options.lora_modules.items():
            adapters.add(name, lora_path)
    return model, config, report, adapters


class EngineParallel:
    """Rank 0's side: the group, the workers, and what it tells them."""

    def __init__(self, group: TensorParallelGroup, workers: Workers) -> None:
        self.group, self.workers = group, workers

    @classmethod
    def start(cls, world: int, device: torch.device, options: ShardOptions
              ) -> tuple["EngineParallel", Any, Any, Any, EngineAdapters | None]:
        """Spawn the workers and load rank 0's shard beside theirs: (driver, model, config, report, adapters)."""
        group, workers = start_workers(world, WORKER, {"options": options}, device)
        try:
            model, config, report, adapters = agreed(group, lambda: _load(group, options))
        except BaseException:
            workers.stop(tell=False)
            raise
        driver = cls(group, workers)
        if adapters is not None:
            adapters.on_change = driver.send
        return driver, model, config, report, adapters

    def send(self, method: str, *args: Any) -> None:
        dead = self.workers.dead()
        if dead is not None:
            raise RuntimeError(f"{dead}: the engine cannot run any more")
        self.group.broadcast((method, args))

    def share_cache(self, kv: PagedKVCache) -> None:
        """The cache rank 0 allocated: each worker allocates the same blocks over its KV heads."""
        self.send("allocate", CacheGeometry(kv.num_blocks, kv.block_size, kv.keys[0].dtype, kv.quant,
                                            kv.num_cold_blocks))

    def broadcast_step(self, plan: StepPlan) -> None:
        self.send("run", plan)

    def stop(self) -> None:
        self.workers.stop()


class EngineWorker:
    """Ranks 1..N-1: a shard, its cache, and a runner without the LM head."""

    def __init__(self, group: TensorParallelGroup, options: ShardOptions) -> None:
        self.group, self.options = group, options
        self.model, self.config, _, self.adapters = agreed(group, lambda: _load(group, options))
        self.runner: ModelRunner | None = None

    def allocate(self, geometry: CacheGeometry) -> None:
        device = self.group.device
        kv = PagedKVCache(self.model.tensor_parallel.local_config, geometry.num_blocks, geometry.block_size,
                          geometry.dtype, device, backend_for(device, self.options.attention_backend),
                          quant=geometry.quant, num_cold_blocks=geometry.num_cold_blocks)
        self.runner = ModelRunner(self.model, kv, None, self.adapters, logits=False)

    def run(self, plan: StepPlan) -> None:
        self.runner.run(plan)

    def adapter_add(self, key: str, adapter: Any) -> None:
        self.adapters.manager.add(key, adapter if not isinstance(adapter, Path) else str(adapter))

    def adapter_remove(self, key: str) -> None:
        self.adapters.manager.remove(key)
