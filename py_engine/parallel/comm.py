"""The process group of a tensor-parallel model, on loopback: the all-reduce and rank 0's commands.

The ranks meet through a FileStore in a temporary folder rank 0 makes (so
no port is chosen, raced for or listened on for the rendezvous: c10d's
TCPStore would listen on every interface), and form two groups:
- the compute group (gloo on CPU, NCCL on CUDA): the layers' all-reduces;
- a gloo group for control: rank 0 broadcasts each command (a step's plan:
  plain ints and lists) and the workers wait for the next one, however long
  the server stays idle (vLLM likewise keeps a CPU group beside NCCL's).
gloo and NCCL bind where GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say; both
are set to the loopback interface unless the caller set them, so nothing
listens or connects beyond this machine (tests/parallel/test_loopback.py).
"""
from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

LOOPBACK = "127.0.0.1"
COMPUTE_TIMEOUT = timedelta(minutes=10)  # between two collectives of one step: a layer's work, not an idle wait
CONTROL_TIMEOUT = timedelta(days=365)  # a worker waits for the next command as long as the server is idle


def loopback_env() -> None:
    """Point torch.distributed's sockets at the loopback interface unless the caller chose others."""
    lo = "lo0" if sys.platform == "darwin" else "lo"
    os.environ.setdefault("MASTER_ADDR", LOOPBACK)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TensorParallelGroup:
    """One rank's view of the group: rank, world, all_reduce, and the control channel.

    Its process groups are private objects over one store (not torch.distributed's default group),
    so one process may hold several sharded models (two LLMs, a server's engine beside a test's)."""

    def __init__(self, rank: int, world: int, device: torch.device, backend: str = "gloo",
                 store: Any = None, store_path: str | None = None) -> None:
        self.rank, self.world, self.device, self.backend = rank, world, device, backend
        self.store_path = store_path
        self.compute = self.control = None
        if world == 1:
            return
        loopback_env()
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, world, CONTROL_TIMEOUT)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COMPUTE_TIMEOUT
            self.compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute/", store), rank, world, options)
        elif backend == "gloo":
            self.compute = dist.ProcessGroupGloo(dist.PrefixStore("compute/", store), rank, world, COMPUTE_TIMEOUT)
        else:
            raise ValueError(f"tensor-parallel backend {backend!r}: use gloo or nccl")

    @classmethod
    def open_store(cls, world: int) -> tuple[Any, str]:
        """Rank 0's rendezvous: a FileStore in a private temporary folder (its path goes to the workers).

        A file, not a TCPStore: c10d's TCP store listens on every interface (::), whatever host it is given."""
        folder = tempfile.mkdtemp(prefix="ruvllm-tp-")
        path = os.path.join(folder, "store")
        return dist.FileStore(path, world), path

    @classmethod
    def join_store(cls, path: str, world: int) -> Any:
        return dist.FileStore(path, world)

    def all_reduce(self, t: Tensor) -> Tensor:
        """The sum over ranks of t, in place (returns t)."""
        if self.world == 1:
            return t
        if self.backend == "gloo" and t.dtype in (torch.bfloat16, torch.float16):
            widened = t.float()  # gloo would sum 16-bit floats in 16 bits: sum in fp32, round once
            self.compute.allreduce([widened]).wait()
            return t.copy_(widened)
        self.compute.allreduce([t]).wait()
        return t

    def broadcast(self, obj: Any) -> None:
        """Rank 0: send obj (picklable) to every worker: its length, then its bytes."""
        if self.world > 1:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            self.control.broadcast(torch.tensor([data.numel()], dtype=torch.int64), 0).wait()
            self.control.broadcast(data, 0).wait()

    def receive(self) -> Any:
        """A worker: the next object rank 0 broadcasts (it is rank 0's own pickle: trusted)."""
        size = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast(size, 0).wait()
        data = torch.empty(int(size), dtype=torch.uint8)
        self.control.broadcast(data, 0).wait()
        return pickle.loads(data.numpy().tobytes())

    def agree(self, error: str | None) -> None:
        """Every rank states whether its set-up worked; all raise the first error any rank had."""
        from .layout import TensorParallelError

        if self.world == 1:
            if error is not None:
                raise TensorParallelError(error)
            return
        mine = (error or "").encode()[:4096]
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self.control.allgather([sizes], [torch.tensor([len(mine)], dtype=torch.int64)]).wait()
        width = max(1, max(int(s) for s in sizes))
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else padded[:0]
        texts = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.world)]
        self.control.allgather([texts], [padded]).wait()
        failed = [(r, bytes(t[:int(n)].tolist()).decode()) for r, (t, n) in enumerate(zip(texts, sizes)) if int(n)]
        if failed:
            rank, message = failed[0]
            raise TensorParallelError(message if rank == self.rank else f"tensor-parallel rank {rank}: {message}")

    def close(self) -> None:
        for pg in (self.compute, self.control):
            if pg is not None and hasattr(pg, "shutdown"):
                try:
                    pg.shutdown()
                except Exception:  # noqa: BLE001 - a peer already gone
                    pass
        self.compute = self.control = None
        if self.store_path is not None and self.rank == 0:
            shutil.rmtree(os.path.dirname(self.store_path), ignore_errors=True)
