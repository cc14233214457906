"""`LLM(model, tensor_parallel_size=N)`: the Python API's one-sequence backend over N ranks.

Rank 0 (the caller's process) runs the generation loop as ever; each
`prefill` / `decode` of a `ShardedTorchBackend` is first broadcast to the
workers, whose `ShardWorker` runs the same call on its own mirror backend
(the same positions, its own dense KV cache of its KV heads), so every rank
reaches each layer's all-reduce together. Workers stop at the final norm:
only rank 0 computes logits.

Calls are serialized by one lock (each rank runs one forward at a time, in
the same order). A backend that is garbage-collected is closed on the
workers with the next command, never from inside the collector.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..backends.torch import TorchBackend
from ..cpu.transforms import optimize_for_cpu
from ..models.kv_quant import KVQuantConfig
from .comm import TensorParallelGroup
from .launch import Workers, start_workers
from .layout import TensorParallelError
from .transform import apply_tensor_parallel

WORKER = "py_engine.parallel.backend:ShardWorker"


def agreed(group: TensorParallelGroup, build: Callable[[], Any]) -> Any:
    """build() on every rank, then one agreement: all ranks raise the first error any rank had."""
    try:
        result, error = build(), None
    except TensorParallelError as exc:  # the layout's own words
        result, error = None, str(exc)
    except Exception as exc:  # noqa: BLE001 - reported to every rank, raised below
        result, error = None, f"{type(exc).__name__}: {exc}"
    group.agree(error)
    return result


def load_shard(group: TensorParallelGroup, path: str | Path, quantization: Any, dtype: str, optimize: bool
               ) -> tuple[Any, Any, Any]:
    """(model, config, quant report) of this rank: loaded whole, transformed for the CPU, then sharded."""
    from ..quant.load import load_quantized

    model, config, report = load_quantized(path, quantization, dtype=dtype, device=group.device)
    if optimize:
        optimize_for_cpu(model)
    apply_tensor_parallel(model, group)
    return model, config, report


def load_adapters(model: Any, lora: dict | None, max_rank: int) -> None:
    if lora:
        from ..adapters import LoraManager

        manager = LoraManager(model, max_rank=max_rank)
        for name, path in lora.items():
            manager.add(name, path)  # cut to this rank's rows and columns (transform.shard_adapter)


class ShardWorker:
    """A worker rank of an LLM: its shard and one mirror backend per open sequence."""

    def __init__(self, group: TensorParallelGroup, path: str, quantization: Any, dtype: str, optimize: bool,
                 lora: dict | None, max_lora_rank: int, max_context: int | None,
                 kv_quant: KVQuantConfig | None) -> None:
        def build() -> Any:
            model, config, _ = load_shard(group, path, quantization, dtype, optimize)
            load_adapters(model, lora, max_lora_rank)
            return model, config

        self.model, self.config = agreed(group, build)
        limit = self.config.max_position_embeddings
        self.max_context, self.kv_quant = min(max_context or limit, limit), kv_quant  # as LLM computes it
        self.backends: dict[int, TorchBackend] = {}

    def open(self, key: int, lora: str | None, closed: list[int]) -> None:
        self.close(closed)
        self.backends[key] = _HiddenOnly(self.model, self.model.tensor_parallel.local_config, self.max_context, lora,
                                         self.kv_quant)

    def call(self, key: int, method: str, args: tuple, closed: list[int]) -> None:
        self.close(closed)
        getattr(self.backends[key], method)(*args)

    def close(self, keys: list[int]) -> None:
        for key in keys:
            self.backends.pop(key, None)


class _HiddenOnly(TorchBackend):
    """A worker's mirror: the decoder's layers (and their all-reduces), no LM head."""

    def _run(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        self.model.model(ids, positions, self.kv)
        return None


class ParallelLLM:
    """Rank 0's side: the group, the workers, the lock, and the sequences to close on the workers."""

    def __init__(self, group: TensorParallelGroup, workers: Workers) -> None:
        self.group, self.workers = group, workers
        self.lock = threading.Lock()
        self._keys = itertools.count()
        self._closed: list[int] = []  # appended by finalizers (any thread, any time), sent with the next command

    @classmethod
    def start(cls, world: int, device: torch.device, path: Path, quantization: Any, dtype: str, optimize: bool,
              lora: dict | None, max_lora_rank: int, max_context: int | None, kv_quant: KVQuantConfig | None,
              backend: str | None = None) -> tuple["ParallelLLM", Any, Any, Any]:
        """Spawn the workers, load and shard rank 0's model beside them: (driver, model, config, report)."""
        kwargs = dict(path=str(path), quantization=quantization, dtype=dtype, optimize=optimize,
                      lora=dict(lora or {}), max_lora_rank=max_lora_rank, max_context=max_context, kv_quant=kv_quant)
        group, workers = start_workers(world, WORKER, kwargs, device, backend)
        try:
            def build() -> Any:
                model, config, report = load_shard(group, path, quantization, dtype, optimize)
                load_adapters(model, lora and dict(lora), max_lora_rank)
                return model, config, report

            model, config, report = agreed(group, build)
        except TensorParallelError:  # every worker heard it too, and is exiting
            workers.stop(tell=False)
            raise
        except Exception:
            workers.stop()
            raise
        driver = cls(group, workers)
        weakref.finalize(driver, workers.stop)
        return driver, model, config, report

    def send(self, method: str, *args: Any) -> None:
        """Broadcast one command (the caller holds self.lock)."""
        dead = self.workers.dead()
        if dead is not None:
            raise RuntimeError(f"{dead}: this LLM cannot run any more; create it again")
        closed, self._closed = self._closed, []
        self.group.broadcast((method, (*args, closed)))

    def new_key(self) -> int:
        return next(self._keys)

    def closed(self, key: int) -> None:
        self._closed.append(key)

    def stop(self) -> None:
        with self.lock:
            self.workers.stop()


class ShardedTorchBackend(TorchBackend):
    """Rank 0's backend: each prefill / decode runs on every rank (the workers first hear of it)."""

    def __init__(self, driver: ParallelLLM, model: Any, config: Any, max_context: int, lora: str | None = None,
                 kv_quant: KVQuantConfig | None = None) -> None:
        super().__init__(model, model.tensor_parallel.local_config, max_context, lora, kv_quant)
        self.vocab_config = config
        self.driver, self.key = driver, driver.new_key()
        self._inside = False
        with driver.lock:
            driver.send("open", self.key, lora)
        weakref.finalize(self, driver.closed, self.key)

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        return self._everywhere("prefill", list(token_ids), super().prefill)

    def decode(self, token_id: int) -> torch.Tensor:
        return self._everywhere("decode", int(token_id), super().decode)

    def _everywhere(self, method: str, arg: Any, run: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """Send the call, then run it here. A call made inside another (decode's prefill at Phi-3's LongRoPE
        switch) is not sent again: the workers' own decode makes it too."""
        if self._inside:
            return run(arg)
        with self.driver.lock:
            self.driver.send("call", self.key, method, (arg,))
            self._inside = True
            try:
                return run(arg)
            finally:
                self._inside = False
