"""A step of T rows of one sequence in one C call (kernels/step.c's rk_rows_step): speculative decoding's k + 1
rows, short prompt chunks.

The module path runs T rows as ~10 Python calls a layer (modules, ctypes, torch.empty, residual adds): on
SmolLM2-135M's 30 layers ~5 ms of a 2-row verify step that costs ~24 ms, when decode (one row, stack.py's
rk_decode_step) costs ~16. rk_rows_step calls the same kernels in the same order with the same arguments
(rk_rms_norm of T rows, rk_qlinear_parts with M = T, rk_attend_rows, the residual adds), so every row gets the
module path's bits, which are decode's (issue 32; tests/cpu/test_cpu_stack.py compares them).

It takes a StackPlan (stack.py: its layers pointed at the cache by `configure`) whose projections are all
quantized (QuantPlans) and carry no adapters, over a DenseKVCache without a cold tier: the other cases keep the
module path (float projections run other kernels for several rows than for one; LoRA deltas are added in torch).
"""
from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from .step_layout import P, NotStackable

ROWS_MAX = 32  # rows a call takes: a speculative step has at most 17 (MAX_SPECULATIVE_TOKENS + 1)


class RowsStep:
    """Work rows for up to ROWS_MAX rows and the call, beside one StackPlan."""

    def __init__(self, plan) -> None:
        if plan.adapters.loras:
            raise NotStackable("adapters add their deltas in torch for several rows")
        for layer in plan.base_layers:
            projs = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if not all(p.quant for p in projs) or not layer.gate_up.gated:
                raise NotStackable("float projections run other kernels for several rows")
        self.plan = plan
        widths = (plan.hidden, (plan.heads + 2 * plan.kv_heads) * plan.head_dim, plan.heads * plan.head_dim,
                  2 * plan.inter, plan.inter, plan.hidden)  # h, qkv, attn, wide, act, tmp: step.c's b[0..5]
        self.buffers = [torch.empty(ROWS_MAX * w, dtype=plan.dtype) for w in widths]
        self.pointers = (P * len(widths))(*(b.data_ptr() for b in self.buffers))
        self._fn = plan.kernels.lib.rk_rows_step

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, position: int) -> Tensor:
        """x [1, T, hidden] (the embeddings, updated in place), cos and sin [1, T, rot] -> final-normed hidden
        states [1, T, hidden]; the plan's cache set (StackPlan.configure) and its lock held by the caller."""
        rows = x.shape[1]
        kv = self.plan.kv
        if not 1 <= rows <= ROWS_MAX or position + rows > kv.max_len:
            raise ValueError(f"{rows} rows at position {position} do not fit a rows step (at most {ROWS_MAX} "
                             f"rows, a cache of max_len {kv.max_len})")
        out = torch.empty_like(x)
        status = self._fn(ctypes.byref(self.plan.step), self.pointers, x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                          cos.shape[-1], position, rows, out.data_ptr())
        if status != 0:
            raise RuntimeError(f"rk_rows_step failed ({'a projection it does not take' if status == -1000 else f'in layer {-status - 1}'}) "
                               f"for {rows} rows at position {position}")
        return out
