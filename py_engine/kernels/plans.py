"""LinearPlan: float weights that read the same input, laid out once for linear.c's rk_linear_parts."""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .binding import CpuKernels


class LinearPlan:
    """Weights that read the same input, laid out once for rk_linear_parts.

    Calling it is one ctypes call: the pointer arrays are built here, not per
    token (building them took longer than a small GEMV). Holds its tensors,
    so they outlive any call; `weights` says which ones it was built for.
    """

    def __init__(self, kernels: CpuKernels, weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> None:
        if not all(kernels.supports_weight(w) and w.dtype == weights[0].dtype
                   and w.shape[1] == weights[0].shape[1] for w in weights) or len(weights) > kernels.MAX_PARTS:
            raise ValueError(f"weights the kernels cannot take: {[(tuple(w.shape), w.dtype) for w in weights]}")
        if not kernels.threads:
            kernels.set_threads(torch.get_num_threads())
        self.weights = list(weights)
        self.biases = [None if b is None else b.contiguous() for b in biases]
        n = len(weights)
        self.dtype = weights[0].dtype
        self.k, self.out = weights[0].shape[1], sum(w.shape[0] for w in weights)
        self._args = (n, (ctypes.c_void_p * n)(*(w.data_ptr() for w in self.weights)),
                      (ctypes.c_void_p * n)(*(_ptr(b) for b in self.biases)),
                      (ctypes.c_int64 * n)(*(w.shape[0] for w in self.weights)))
        self._fn = kernels.lib.rk_linear_parts

    def __call__(self, x: Tensor) -> Tensor:
        """x [..., K] of the weights' dtype, on the CPU -> [..., sum of N]."""
        if x.dtype != self.dtype or not x.is_cpu:  # the C side would misread it
            raise ValueError(f"x of {x.dtype} on {x.device} for {self.dtype} weights on the CPU")
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], self.out, dtype=self.dtype)
        bf16 = self.dtype == torch.bfloat16
        n, w_ptrs, b_ptrs, sizes = self._args
        status = self._fn(x.data_ptr(), bf16, n, w_ptrs, bf16, b_ptrs, bf16, sizes, y.data_ptr(), bf16,
                          x.numel() // self.k, self.k)
        if status != 0:
            raise RuntimeError(f"rk_linear_parts failed ({status}) for x {tuple(x.shape)} {x.dtype}, "
                               f"weights {[tuple(w.shape) for w in self.weights]} {self.dtype}")
        return y


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
