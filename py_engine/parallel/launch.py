"""Worker processes of a tensor-parallel model: rank 0 is the caller, ranks 1..N-1 are spawned here.

    group, workers = start_workers(2, "py_engine.parallel.backend:ShardWorker", {"path": ..., ...}, device)
    ...                            # rank 0 loads and shards its own copy, then drives: group.broadcast(cmd)
    workers.stop()                 # broadcasts None: each worker leaves its loop and exits

A worker joins the group, builds `target(group, **kwargs)` (which loads and
shards the model, and states through group.agree whether that worked), then
runs each command rank 0 broadcasts: (method name, args) called on that
object, until None. Workers are fresh interpreters (never forked: torch's
threads and the CPU kernels' pool do not survive a fork); a worker exits
when rank 0's connection breaks or rank 0's process is gone.

Threads: each rank gets its share of the CPUs this process may use
(cores // N torch threads, at least one), and on a NUMA machine with at
least N nodes each rank is pinned to one node's CPUs, as vLLM's CPU backend
does (its weights and KV cache are then first-touched on that node).
"""
from __future__ import annotations

import importlib
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .comm import TensorParallelGroup, default_backend
from .layout import TensorParallelError

logger = logging.getLogger("ruvllm.parallel")


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world: int
    store: str  # the FileStore's path
    target: str  # "module:callable", called as target(group, **kwargs)
    kwargs: dict = field(default_factory=dict)
    device: str = "cpu"
    backend: str = "gloo"
    cpus: tuple[int, ...] | None = None  # pin to these CPUs (NUMA), else just the thread count
    threads: int = 1


def numa_nodes() -> list[tuple[int, ...]]:
    """The CPUs of each NUMA node this process may run on (Linux sysfs), [] elsewhere."""
    root = Path("/sys/devices/system/node")
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    nodes = []
    for node in sorted(root.glob("node[0-9]*")):
        try:
            cpus = _cpu_list((node / "cpulist").read_text())
        except OSError:
            continue
        mine = tuple(c for c in cpus if c in allowed)
        if mine:
            nodes.append(mine)
    return nodes


def _cpu_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def cpu_plan(world: int) -> list[tuple[tuple[int, ...] | None, int]]:
    """(CPUs to pin or None, torch threads) per rank.

    $OMP_NUM_THREADS, when set, is the whole group's budget, shared out and never pinned: Ray sets it to an
    actor's reserved CPUs, so a tensor-parallel replica's ranks stay within --cpus-per-replica."""
    budget = _thread_budget()
    nodes = numa_nodes()
    if budget is None and len(nodes) >= world > 1:
        return [(nodes[r], len(nodes[r])) for r in range(world)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return [(None, max(1, min(cores, budget or cores) // world))] * world


def _thread_budget() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def apply_cpus(cpus: tuple[int, ...] | None, threads: int) -> None:
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)


ONE_DEVICE = "RUVLLM_TP_ONE_DEVICE"  # "1": every rank on the device given (a one-GPU check, with gloo)
BACKEND = "RUVLLM_TP_BACKEND"  # gloo or nccl instead of the device's default


def device_of(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r when each rank has a GPU of its own (unless $RUVLLM_TP_ONE_DEVICE=1); the CPU
    stays the CPU."""
    if device.type != "cuda" or os.environ.get(ONE_DEVICE) == "1":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class Workers:
    """The spawned ranks 1..N-1 (rank 0 holds the group)."""

    def __init__(self, group: TensorParallelGroup, processes: list["WorkerProcess"]) -> None:
        self.group, self.processes = group, processes
        self.stopped = False

    def dead(self) -> str | None:
        """A line naming a worker that has exited, or None while all run."""
        for rank, p in enumerate(self.processes, start=1):
            if not p.is_alive():
                return f"tensor-parallel rank {rank} exited (code {p.exitcode})"
        return None

    def stop(self, timeout: float = 30.0, tell: bool = True) -> None:
        """Tell every worker to exit (unless they know already), wait for them, close the group (idempotent)."""
        if self.stopped:
            return
        self.stopped = True
        if tell and self.dead() is None:
            try:
                self.group.broadcast(None)
            except Exception:  # noqa: BLE001 - a broken group: the workers are killed below
                logger.warning("could not tell the tensor-parallel workers to stop; terminating them")
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
                p.join(5)
        self.group.close()


def start_workers(world: int, target: str, kwargs: dict, device: torch.device,
                  backend: str | None = None) -> tuple[TensorParallelGroup, Workers]:
    """Spawn ranks 1..world-1 and join the group as rank 0 (this process's threads set to its share)."""
    backend = backend or os.environ.get(BACKEND) or default_backend(device)
    plan = cpu_plan(world)
    if (device.type == "cuda" and backend == "nccl" and os.environ.get(ONE_DEVICE) != "1"
            and (device.index or 0) + world > torch.cuda.device_count()):
        raise TensorParallelError(f"tensor_parallel_size {world} needs {world} CUDA devices from {device}, this "
                                  f"machine has {torch.cuda.device_count()} (NCCL takes one GPU per rank)")
    store, store_path = TensorParallelGroup.open_store(world) if world > 1 else (None, None)
    processes = []
    for rank in range(1, world):
        cpus, threads = plan[rank]
        spec = WorkerSpec(rank, world, store_path, target, kwargs, str(device_of(device, rank)), backend, cpus,
                          threads)
        processes.append(WorkerProcess(spec))
    apply_cpus(*plan[0])
    try:
        group = TensorParallelGroup(0, world, device_of(device, 0), backend, store, store_path)
    except Exception:
        for p in processes:
            p.kill()
        raise
    return group, Workers(group, processes)


class WorkerProcess:
    """One worker: `python -m py_engine.parallel.launch` reading its pickled WorkerSpec from stdin.

    A fresh interpreter rather than multiprocessing's spawn, which re-imports the caller's main module:
    a script without an `if __name__ == "__main__"` guard would start its work again in every worker."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.rank = spec.rank
        root = str(Path(__file__).resolve().parents[2])  # the checkout or site-packages holding py_engine
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.popen = subprocess.Popen([sys.executable, "-m", "py_engine.parallel.launch"], stdin=subprocess.PIPE,
                                      env=env)
        self.popen.stdin.write(pickle.dumps(spec))
        self.popen.stdin.close()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait()


def _orphan_watch(parent: int) -> None:
    """Exit when rank 0's process is gone (it was killed before it could tell this worker to stop)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def worker_main(spec: WorkerSpec) -> None:
    """A worker's whole life: join, build the target, run rank 0's commands until None."""
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), daemon=True).start()
    apply_cpus(spec.cpus, spec.threads)
    store = TensorParallelGroup.join_store(spec.store, spec.world)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TensorParallelGroup(spec.rank, spec.world, device, spec.backend, store)
    module, _, name = spec.target.partition(":")
    try:
        worker = getattr(importlib.import_module(module), name)(group, **spec.kwargs)
    except TensorParallelError:  # every rank agreed on the error: rank 0 raises it to its caller
        group.close()
        return
    except Exception:  # noqa: BLE001 - the target failed outside the agreement: rank 0's collective breaks
        traceback.print_exc()
        group.close()
        return
    try:
        while True:
            command = group.receive()
            if command is None:
                break
            method, args = command
            getattr(worker, method)(*args)
    except Exception:  # noqa: BLE001 - rank 0 sees the group break (its collective fails) and says why
        traceback.print_exc()
    finally:
        group.close()


if __name__ == "__main__":
    worker_main(pickle.loads(sys.stdin.buffer.read()))
