"""`LLM(model, tensor_parallel_size=N)`: the Python API's one-sequence backend over N ranks.

Rank 0 (the caller's process) runs the generation loop as ever; each
`prefill` / `decode` of its TorchBackend goes through a `SequenceMirror`,
which first broadcasts the call to the workers, whose `ShardWorker` runs it
on its own TorchBackend of that sequence (the same positions, its own dense
KV cache of its KV heads, no LM head: only rank 0 computes logits), so every
rank reaches each layer's all-reduce together. The backend class comes in
as an argument (py_engine.backends imports this package, not the reverse).

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

from ..cpu.transforms import optimize_for_cpu
from ..models.hugepages import no_arenas
from ..models.kv_quant import KVQuantConfig
from ..models.memory import trim_heap
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

    with no_arenas():  # each matrix its own tensor: the slices below are copies, the rest is freed
        model, config, report = load_quantized(path, quantization, dtype=dtype, device=group.device)
    if optimize:
        optimize_for_cpu(model)
    apply_tensor_parallel(model, group)
    trim_heap()  # the whole checkpoint was loaded: give back what the other ranks' slices held
    return model, config, report


def load_adapters(model: Any, lora: dict | None, max_rank: int) -> None:
    if lora:
        from ..adapters import LoraManager

        manager = LoraManager(model, max_rank=max_rank)
        for name, path in lora.items():
            manager.add(name, path)  # cut to this rank's rows and columns (transform.shard_adapter)


class ShardWorker:
    """A worker rank of an LLM: its shard and one backend (backend_class, layers only) per open sequence."""

    def __init__(self, group: TensorParallelGroup, backend_class: type, path: str, quantization: Any, dtype: str,
                 optimize: bool, lora: dict | None, max_lora_rank: int, max_context: int | None,
                 kv_quant: KVQuantConfig | None) -> None:
        def build() -> Any:
            model, config, _ = load_shard(group, path, quantization, dtype, optimize)
            load_adapters(model, lora, max_lora_rank)
            return model, config

        self.model, self.config = agreed(group, build)
        limit = self.config.max_position_embeddings
        self.max_context = min(max_context or limit, limit)  # as LLM computes it
        self.backend_class, self.kv_quant = backend_class, kv_quant
        self.backends: dict[int, Any] = {}

    def open(self, key: int, lora: str | None, closed: list[int]) -> None:
        self.close(closed)
        self.backends[key] = self.backend_class(self.model, self.model.tensor_parallel.local_config,
                                                self.max_context, lora, self.kv_quant, logits=False)

    def call(self, key: int, method: str, args: tuple, closed: list[int]) -> None:
        self.close(closed)
        getattr(self.backends[key], method)(*args)

    def close(self, keys: list[int]) -> None:
        for key in keys:
            self.backends.pop(key, None)


class SequenceMirror:
    """Rank 0's link from one sequence's backend to its copies on the workers."""

    def __init__(self, driver: "ParallelLLM", key: int) -> None:
        self.driver, self.key = driver, key
        weakref.finalize(self, driver.closed, key)

    def run(self, method: str, arg: Any, local: Callable[[Any], Any]) -> Any:
        """Send the call to the workers, then run it here, under the driver's lock (one forward at a time)."""
        with self.driver.lock:
            self.driver.send("call", self.key, method, (arg,))
            return local(arg)


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
              backend_class: type, backend: str | None = None) -> tuple["ParallelLLM", Any, Any, Any]:
        """Spawn the workers, load and shard rank 0's model beside them: (driver, model, config, report)."""
        kwargs = dict(backend_class=backend_class, path=str(path), quantization=quantization, dtype=dtype,
                      optimize=optimize, lora=dict(lora or {}), max_lora_rank=max_lora_rank,
                      max_context=max_context, kv_quant=kv_quant)
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

    def open(self, lora: str | None) -> SequenceMirror:
        """A new sequence on every worker; its mirror for rank 0's backend."""
        key = next(self._keys)
        with self.lock:
            self.send("open", key, lora)
        return SequenceMirror(self, key)

    def send(self, method: str, *args: Any) -> None:
        """Broadcast one command (the caller holds self.lock)."""
        dead = self.workers.dead()
        if dead is not None:
            raise RuntimeError(f"{dead}: this model cannot run any more; create it again")
        closed, self._closed = self._closed, []
        self.group.broadcast((method, (*args, closed)))

    def closed(self, key: int) -> None:
        self._closed.append(key)

    def stop(self) -> None:
        with self.lock:
            self.workers.stop()
