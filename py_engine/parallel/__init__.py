"""Tensor parallelism: one model sharded over N processes that sum their partial results with torch.distributed.

    layout.py     which heads and channels each rank holds (pure Python); TensorParallelError
    shard.py      slices of Linear / QuantLinear / FusedLinear: output rows or input columns
    transform.py  apply_tensor_parallel(model, group): the shard as a transform of the unchanged model,
                  an all-reduce after each attention and MLP; LoRA adapters cut to match
    comm.py       the process group on loopback (gloo on CPU, NCCL on CUDA) and rank 0's command channel
    launch.py     spawning ranks 1..N-1 and their command loop; threads and NUMA pinning per rank
    backend.py    LLM(..., tensor_parallel_size=N): the Python API's sharded backend

The server's engine (native_server/engine/parallel.py) uses the same
pieces: its scheduler runs on rank 0, which broadcasts each step's plan.
"""
from .layout import TensorParallelError, shard_layout, split_range

__all__ = ["TensorParallelError", "shard_layout", "split_range"]
