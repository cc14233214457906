"""Transforms that make a loaded `CausalLM` fast on CPU; the model code stays as it is.

    model, config = load_model(path, dtype="bfloat16")
    applied = optimize_for_cpu(model)  # e.g. ["fuse_projections", "cpu_kernels", "cpu_layers"]

- `fuse_projections`: q/k/v become one `qkv_proj` and gate/up one
  `gate_up_proj` (the names Phi-3 checkpoints use, so the model's fused
  branch runs them), each a `FusedLinear` that keeps the original Linears
  rather than copying their weights into one matrix: float32 weights are
  mapped from the checkpoint, and a copy would add 1.1 GB of resident memory
  to Qwen2.5-0.5B. Decode is a chain of small GEMVs; one call instead of
  three (or two) saves per-call overhead and gives the thread pool longer runs.
- `use_cpu_kernels`: each `nn.Linear` becomes a `KernelLinear` (and each
  FusedLinear one kernel call) on py_engine.kernels: AVX2 GEMV/GEMM with bf16
  widened in registers (torch's bf16 GEMM has no fast path on CPUs without
  AVX-512 BF16) on a thread pool without barriers (see kernels/pool.h;
  numbers in benchmarks/README.md).
- `use_cpu_layers`: norms, rope, cache write, attention and the SiLU gate
  of a decode step in C as well (layers.py), and a whole decode step of one
  sequence as one C call (stack.py).

All keep the parameters (a tied LM head stays tied) and the arithmetic:
float32 accumulation with one rounding at the end, as torch does.

A forward should run inside `kernel_step(kernels)`: torch single-threaded,
the kernels' pool on torch's thread count. What is left to torch is small
(norms, rope, attention, elementwise ops, an argmax), and on a busy machine
each of its OpenMP regions can wait a whole scheduler slice for its second
thread: a 150k-element argmax measured ~11 ms with 2 threads, ~0.05 ms with
1; in a 128-token prefill, elementwise ops took 5 of 10 seconds that way.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import CpuKernels, cpu_kernels, kernel_step  # noqa: F401 (kernel_step: re-exported)
from ..models.layers import MLP, Attention, RMSNorm
from ..models.skeleton import skeleton
from ..models.transformer import CausalLM, DecoderModel
from .layers import KernelAttention, KernelMLP, KernelRMSNorm
from .linears import FusedLinear, KernelLinear, quantized_types
from .stack import KernelDecoderModel


def optimize_for_cpu(model: CausalLM) -> list[str]:
    """Apply every CPU transform that fits this model and machine; return their names."""
    if next(model.parameters()).device.type != "cpu":
        return []
    applied = ["fuse_projections"] if fuse_projections(model) else []
    kernels = cpu_kernels()
    if kernels is not None and use_cpu_kernels(model, kernels):
        kernels.set_threads(torch.get_num_threads())
        applied.append("cpu_kernels")
        if use_cpu_layers(model, kernels):
            applied.append("cpu_layers")
    return applied


def fuse_projections(model: CausalLM) -> int:
    """Fuse q/k/v and gate/up projections in place; return how many modules changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, Attention) and not module.fused:
            module.qkv_proj = FusedLinear([module.q_proj, module.k_proj, module.v_proj])
            del module.q_proj, module.k_proj, module.v_proj
        elif isinstance(module, MLP) and not module.fused:
            module.gate_up_proj = FusedLinear([module.gate_proj, module.up_proj])  # gate first, as forward chunks
            del module.gate_proj, module.up_proj
        else:
            continue
        module.fused = True
        changed += 1
    return changed


def use_cpu_kernels(model: nn.Module, kernels: CpuKernels) -> int:
    """Put the kernels under every Linear (sharing its parameters); return how many modules use them."""
    fused = [m for m in model.modules() if isinstance(m, FusedLinear)]
    inside = {id(p) for f in fused for p in f.parts}  # run by their FusedLinear
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and id(child) not in inside]
    for parent, name, old in swaps:
        with skeleton():  # its parameters are old's
            new = KernelLinear(old.in_features, old.out_features, bias=old.bias is not None)
        new.weight, new.bias, new.kernels = old.weight, old.bias, kernels
        setattr(parent, name, new)
    for f in fused:
        f.kernels = kernels
    takers = [m for m in model.modules() if isinstance(m, quantized_types())]
    for m in takers:  # quantized layers (py_engine.quant) run on these kernels already: recorded for kernel_step
        m.kernels = kernels
    if isinstance(model, CausalLM):
        model.tie_weights()
    return len(swaps) + len(fused) + len(takers)


def row_invariance_problem(model: nn.Module) -> str | None:
    """Why a row of this model's forward could depend on the rows that come with it (None: it cannot).

    With every projection on the kernels, every norm KernelRMSNorm and every attention KernelAttention's C
    path (fused qkv, no qk-norm, head_dim a multiple of 8), a token's logits are the same bits in decode,
    in a prompt chunk and in a speculative verify pass (the kernels' one arithmetic per row). Anything left
    to torch for several rows (SDPA, MKL, a MoE's routing) may not be."""
    if model_kernels(model) is None:
        return "the CPU kernels are not under the model"
    fused = {id(p) for f in model.modules() if isinstance(f, FusedLinear) and f.kernels is not None for p in f.parts}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not isinstance(module, KernelLinear) and id(module) not in fused:
            return f"{name} is a torch Linear"
        if isinstance(module, RMSNorm) and not isinstance(module, KernelRMSNorm):
            return f"{name} is torch's RMSNorm"
        if isinstance(module, Attention):
            if not isinstance(module, KernelAttention) or not module.fused or module.qk_norm or module.head_dim % 8:
                return f"{name} attends in torch (qk-norm, unfused projections or head_dim {module.head_dim})"
        if type(module).__name__ == "SparseMoE":
            return f"{name} routes experts in torch"
    return None


def model_kernels(model: nn.Module) -> CpuKernels | None:
    """The kernels a model's Linears use, or None if use_cpu_kernels was not applied."""
    return next((m.kernels for m in model.modules() if isinstance(m, (KernelLinear, FusedLinear, *quantized_types()))
                 and m.kernels is not None), None)


def use_cpu_layers(model: nn.Module, kernels: CpuKernels) -> int:
    """Give RMSNorm, Attention and MLP modules their kernel subclass, and the decoder the one-call
    decode step (stack.py); return how many."""
    swaps = {RMSNorm: KernelRMSNorm, Attention: KernelAttention, MLP: KernelMLP, DecoderModel: KernelDecoderModel}
    count = 0
    for module in model.modules():
        kind = swaps.get(type(module))
        if kind is not None:
            module.__class__ = kind
            module.kernels = kernels
            count += 1
    return count


