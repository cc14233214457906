"""The process group of a tensor-parallel model, on loopback: the all-reduce and rank 0's commands.

Two groups over one TCPStore that rank 0 opens on 127.0.0.1 (port 0: the
system picks a free one, so two engines never race for a port):
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
import sys
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
    """One rank's view of the group: rank, world, all_reduce, and the control channel."""

    def __init__(self, rank: int, world: int, device: torch.device, backend: str = "gloo",
                 store: Any = None) -> None:
        self.rank, self.world, self.device, self.backend = rank, world, device, backend
        self.control = None
        self._gloo_dtype: torch.dtype | None = None
        if world == 1:
            return
        loopback_env()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=COMPUTE_TIMEOUT,
                                device_id=device if device.type == "cuda" else None)
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)  # with gloo too: its own timeout

    @classmethod
    def open_store(cls, world: int) -> Any:
        """Rank 0's TCPStore on 127.0.0.1 at a free port (store.port)."""
        loopback_env()
        return dist.TCPStore(LOOPBACK, 0, world, is_master=True, timeout=COMPUTE_TIMEOUT, wait_for_workers=False)

    @classmethod
    def join_store(cls, port: int, world: int) -> Any:
        loopback_env()
        return dist.TCPStore(LOOPBACK, port, world, is_master=False, timeout=COMPUTE_TIMEOUT)

    def all_reduce(self, t: Tensor) -> Tensor:
        """The sum over ranks of t, in place when it can be (returns the summed tensor)."""
        if self.world == 1:
            return t
        if self.backend == "gloo" and t.dtype in (torch.bfloat16, torch.float16):
            widened = t.float()  # gloo sums 16-bit floats in 16 bits: sum in fp32, round once, as one matmul would
            dist.all_reduce(widened)
            return t.copy_(widened)
        dist.all_reduce(t)
        return t

    def broadcast(self, obj: Any) -> None:
        """Rank 0: send obj (picklable) to every worker."""
        if self.world > 1:
            dist.broadcast_object_list([obj], src=0, group=self.control)

    def receive(self) -> Any:
        """A worker: the next object rank 0 broadcasts."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def agree(self, error: str | None) -> None:
        """Every rank states whether its set-up worked; all raise the first error any rank had."""
        if self.world == 1:
            if error is not None:
                raise RuntimeError(error)
            return
        errors: list[Any] = [None] * self.world
        dist.all_gather_object(errors, error, group=self.control)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            from .layout import TensorParallelError
            rank, message = failed[0]
            raise TensorParallelError(message if rank == self.rank else f"tensor-parallel rank {rank}: {message}")

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
