"""Modules built on the meta device without running their initializers.

    with skeleton():
        model = CausalLM(config)  # every parameter on "meta": shapes only

`nn.Linear` and `nn.Embedding` fill their weights in `__init__` (kaiming_uniform_, normal_). On the
meta device those calls dispatch to torch._refs, whose first use imports torch._dynamo and with it
Triton: ~145 MB of resident memory (RSS), a fifth of Qwen2.5-0.5B's int8 weights, to initialise
tensors that hold no data. Inside `skeleton()`, torch.nn.init's functions return a meta tensor as it
is and run unchanged for any other tensor, so another thread initialising a real module meanwhile
is unaffected.
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_")
_lock = threading.Lock()
_depth = 0
_saved: dict[str, Callable] = {}


def _skip_meta(init: Callable) -> Callable:
    @functools.wraps(init)
    def wrapper(tensor: torch.Tensor, *args, **kwargs):
        return tensor if tensor.is_meta else init(tensor, *args, **kwargs)
    return wrapper


@contextmanager
def skeleton() -> Iterator[None]:
    """torch.device("meta") with nn.init skipped for meta tensors (re-entrant, thread-safe)."""
    global _depth
    with _lock:
        if _depth == 0:
            for name in INITIALIZERS:
                _saved[name] = getattr(nn.init, name)
                setattr(nn.init, name, _skip_meta(_saved[name]))
        _depth += 1
    try:
        with torch.device("meta"):
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name, init in _saved.items():
                    setattr(nn.init, name, init)
                _saved.clear()
