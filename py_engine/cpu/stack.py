"""A whole decode step in one C call (kernels/step.c), over the plans the modules already hold.

After `use_cpu_layers` a decode step of one sequence still makes ~10 Python
calls per layer (modules, ctypes, torch.empty, residual adds): ~4.5 ms per
token of Qwen2.5-0.5B, 15-20% of an int8 token. `KernelDecoderModel` runs the
first decode step the usual way, which builds every module's kernel plan
(LinearPlan weights, QuantPlan matrices), then lays those plans out once as a
`StackPlan` and runs later steps as one `rk_decode_step` call: the same
kernels in the same order on the same arguments, so the hidden states are
bit for bit the per-module path's (tests/cpu/test_cpu_stack.py checks that).

A step takes this path only when every layer is the plain pre-norm block
(no sandwich norms, no experts, no qk-norm, a SiLU gate) on the kernels, one
sequence decodes one token over a DenseKVCache, and nothing has changed
since the plan was laid out. Before each step `StackPlan.valid` compares
~20 object identities per layer (modules, parameters, plans, the quantized
layers' tokens, the cache tensors): a swapped module, a moved or re-quantized
layer or a new cache makes it fall back and lay the plan out again. Forward
hooks on the blocks are not called on this path; `stack_enabled = False`
turns it off (the benchmarks' `ruvllm:nostack`).

LoRA and X-LoRA (py_engine.adapters): a LoraLinear's base is laid out as any
projection; which adapter columns (or merged weight copies) each step reads is
stack_adapters.py's StackAdapters, one per plan. The ctypes mirrors of step.c's
structures are step_layout.py's.

A paged cache (the server: one sequence decoding one token, handed over as a
`PagedStepView` by native_server's PagedKVStep.decode_view) is one kind of
cache: its setup points the layers at the paged blocks and the cold pool, and
each step sets the sequence's block table, length and slot (`set_row`); step.c
then calls paged.c's attention instead of the dense one.

Each (cache, adapter state) pair the steps meet is one `_Setup`: its own copy of
the layer array with the cache's pointers and the adapters' columns set, so
alternating between them (X-LoRA's scaling pass on its half of the cache with
no adapter, then the real pass) switches one pointer. The last few are kept;
adding or removing an adapter drops them all.
"""
from __future__ import annotations

import ctypes
import operator
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..adapters.layer import LoraLinear
from ..kernels import ColdTier, CpuKernels
from ..kernels.paged import KV_TYPES, MAX_GROUP_FLOATS, MAX_HEAD_DIM, PagedDecode, PagedStepView
from ..models.kv_cache import DenseKVCache, TwoTierDenseKVCache
from ..models.transformer import DecoderLayer, DecoderModel
from .layers import DTYPES, KernelAttention, KernelMLP, KernelRMSNorm
from .linears import FusedLinear, KernelLinear
from .stack_adapters import StackAdapters
from .stack_rows import ROWS_MAX, RowsStep
from .step_layout import P, Layer, NotStackable, Proj, Step

SETUPS = 4  # (cache, adapter state) setups kept


class StackPlan:
    """The C description of every layer of `model` for steps of dtype over `kv`, with what must stay the same."""

    def __init__(self, model: DecoderModel, kernels: CpuKernels, dtype: torch.dtype, kv: DenseKVCache) -> None:
        self.kernels, self.dtype = kernels, dtype
        self.lock = threading.Lock()  # steps from several threads (one model, several caches) take turns
        self.checks: list[tuple[dict, str, object]] = []  # (a __dict__/_modules/_parameters, key, the object)
        self.keep: list[object] = []  # what the C structures point into
        self.adapters = StackAdapters(self)  # LoRA / X-LoRA columns and merges (stack_adapters.py)
        self.float_parts: dict[tuple[int, str], tuple] = {}  # (layer, field) -> float (weights, biases, gated)
        self._last_float: tuple | None = None
        layers = list(model.layers)
        first = layers[0] if layers else None
        if not layers or not isinstance(first, DecoderLayer):
            raise NotStackable("no decoder layers")
        attn0, mlp0 = first.self_attn, _get(first, "mlp")
        self.hidden = first.input_layernorm.weight.shape[0]
        self.heads, self.kv_heads, self.head_dim = attn0.n_heads, attn0.n_kv_heads, attn0.head_dim
        self.inter = _down_in(mlp0)
        self.eps, self.unit_offset = model.norm.eps, model.norm.unit_offset
        self._watch(model._modules, "layers", model.layers)
        for i, layer in enumerate(layers):  # a replaced or added layer is noticed too
            self._watch(model.layers._modules, str(i), layer)
        self._watch(model.layers._modules, str(len(layers)), None)
        self._watch(model._modules, "norm", model.norm)
        self.final_norm = self._norm(model.norm)
        self.layers = (Layer * len(layers))(*(self._layer(i, layer) for i, layer in enumerate(layers)))
        self.base_layers = self.layers  # no cache, no adapter: what each _Setup copies
        self._columns = tuple(zip(*self.checks))  # (containers, keys, objects): valid() maps over them in C
        self.buffers = {name: torch.empty(size, dtype=dtype) for name, size in (
            ("h", self.hidden), ("qkv", (self.heads + 2 * self.kv_heads) * self.head_dim),
            ("attn", self.heads * self.head_dim), ("wide", 2 * self.inter), ("act", self.inter),
            ("tmp", self.hidden))}
        b = self.buffers
        self.step = Step(ctypes.addressof(self.layers), self.final_norm, len(layers), self.hidden, self.heads,
                         self.kv_heads, self.head_dim, 0, self.inter, self.eps, int(self.unit_offset),
                         int(dtype == torch.bfloat16), b["h"].data_ptr(), b["qkv"].data_ptr(), b["attn"].data_ptr(),
                         b["wide"].data_ptr(), b["act"].data_ptr(), b["tmp"].data_ptr(), None, None, None, None)
        self._setups: dict[tuple, _Setup] = {}  # (id(kv), adapter state) -> its setup, oldest first
        widest_in = max(self.hidden, self.heads * self.head_dim, self.inter)
        widest_out = max((self.heads + 2 * self.kv_heads) * self.head_dim, self.hidden, 2 * self.inter)
        self.lora_x, self.lora_d = torch.empty(widest_in), torch.empty(widest_out)  # step.c's fp32 x and delta
        self.step.lora_x, self.step.lora_d = self.lora_x.data_ptr(), self.lora_d.data_ptr()
        self.kv: DenseKVCache | None = None
        self._setup: _Setup | None = None
        self._fn = kernels.lib.rk_decode_step
        self._rows: RowsStep | bool | None = None  # stack_rows.py's step of several rows; False: not for this model

    def rows_step(self) -> RowsStep | None:
        """The step of T rows over this plan (stack_rows.py), or None when the model's layers cannot take it."""
        if self._rows is None:
            try:
                self._rows = RowsStep(self)
            except NotStackable:
                self._rows = False
        return self._rows or None

    # what must not change -------------------------------------------------------------------------------
    def _watch(self, container: dict, key: str, obj: object) -> None:
        """Record that container[key] must stay obj (it is now)."""
        if container.get(key) is not obj:
            raise NotStackable(f"{key} is not where it was read")
        self.checks.append((container, key, obj))

    def valid(self) -> bool:
        """Whether the plan still describes the model: ~20 identities a layer, compared in C (map)."""
        containers, keys, objects = self._columns
        return all(map(operator.is_, map(dict.get, containers, keys), objects))

    # laying it out ----------------------------------------------------------------------------------------
    def _layer(self, i: int, layer: nn.Module) -> Layer:
        if type(layer) is not DecoderLayer or layer.sandwich or layer.moe:
            raise NotStackable(f"layer {i} is not a plain pre-norm block")
        if layer._forward_hooks or layer._forward_pre_hooks:
            raise NotStackable(f"layer {i} has forward hooks")
        attn, mlp = layer.self_attn, _get(layer, "mlp")
        if type(attn) is not KernelAttention or not attn.fused or attn.qk_norm or type(mlp) is not KernelMLP:
            raise NotStackable(f"layer {i}: attention or MLP is not on the kernels")
        if mlp.act is not F.silu or _down_in(mlp) != self.inter:
            raise NotStackable(f"layer {i}: not a SiLU gate of the first layer's width")
        if (attn.n_heads, attn.n_kv_heads, attn.head_dim) != (self.heads, self.kv_heads, self.head_dim):
            raise NotStackable(f"layer {i}: head counts differ from layer 0's")
        if self.head_dim % 8:
            raise NotStackable("head_dim is not a multiple of 8")
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            self._watch(layer._modules, name, layer._modules.get(name))
        projs = {}
        for module, name, field in ((attn, "qkv_proj", "qkv"), (attn, "o_proj", "o"), (mlp, "gate_up_proj", "gate_up"),
                                    (mlp, "down_proj", "down")):
            base = self._unwrap(i, field, module, name)
            self._last_float = None
            projs[field] = self._gate_up(mlp, base) if field == "gate_up" else self._proj(base)
            if self._last_float is not None:  # what a merged adapter's copies are made from
                self.float_parts[(i, field)] = self._last_float
        spec = attn.spec
        return Layer(self._norm(layer.input_layernorm), self._norm(layer.post_attention_layernorm),
                     projs["qkv"], projs["o"], projs["gate_up"], projs["down"], None, None,
                     spec.sliding_window or 0, spec.scale, spec.softcap or 0.0)

    def _unwrap(self, i: int, field: str, parent: nn.Module, name: str) -> nn.Module:
        """The projection the kernels run; a LoraLinear's base, its adapters noted for configure."""
        module = parent._modules.get(name)
        self._watch(parent._modules, name, module)
        if not isinstance(module, LoraLinear):
            return module
        self.adapters.add(i, field, module)
        self._watch(module._modules, "base", module.base)
        return module.base

    def _norm(self, norm: nn.Module) -> int:
        if type(norm) is not KernelRMSNorm or (norm.eps, norm.unit_offset) != (self.eps, self.unit_offset):
            raise NotStackable("a norm is not on the kernels, or not of the final norm's eps and kind")
        w = norm.weight
        if w.dtype != self.dtype or not w.is_cpu or not w.is_contiguous() or w.shape != (self.hidden,):
            raise NotStackable("a norm's weight is not of the step's dtype and width")
        self._watch(norm._parameters, "weight", w)
        return w.data_ptr()

    def _proj(self, module: nn.Module, gated: bool = False) -> Proj:
        """A projection's kernel call: the QuantPlan or the float weights its own forward would use;
        gated: a gate/up pair, silu(gate(x)) * up(x)."""
        quant = _quant_plan(module)
        if quant is None:
            linears = self._float_linears(module)
            return self._float_proj([lin.weight for lin in linears], [lin.bias for lin in linears], gated)
        plan, parts = quant
        if gated and (len(parts) != 2 or parts[0].out_features != parts[1].out_features):
            raise NotStackable("gate/up are not two parts of one width")
        self._watch(module.__dict__, "_quant_plan" if parts else "_plan", plan)
        for i, part in enumerate(parts):
            self._watch(module.parts._modules, str(i), part)
            self._watch(part.__dict__, "_token", plan.key[i])
        self.keep.append(plan)
        out = parts[0].out_features if gated else plan.out
        return Proj(ctypes.addressof(plan._mats), None, None, 1, len(plan.weights), plan.mode, int(gated), out)

    def _gate_up(self, mlp: KernelMLP, proj: nn.Module) -> Proj:
        """silu(gate(x)) * up(x) as KernelMLP.forward computes it (proj: gate_up_proj, unwrapped)."""
        if type(proj) is FusedLinear and _quant_plan(proj) is not None:
            return self._proj(proj, gated=True)
        weights = mlp._gate_up(proj)  # separate gate and up weights (Phi-3's stored [2 I, H] as two views)
        if weights is None:
            raise NotStackable("gate/up are not float weights on the kernels")
        self._float_linears(proj)
        w_gate, w_up, b_gate, b_up = weights
        return self._float_proj([w_gate, w_up], [b_gate, b_up], gated=True)

    def _float_linears(self, module: nn.Module) -> list[nn.Linear]:
        """The float Linears behind a kernel projection (a FusedLinear's parts, or a KernelLinear), watched."""
        if isinstance(module, FusedLinear) and all(type(p) is nn.Linear for p in module.parts):
            linears = list(module.parts)
            for i, part in enumerate(linears):
                self._watch(module.parts._modules, str(i), part)
        elif type(module) is KernelLinear:
            linears = [module]
        else:
            raise NotStackable(f"{type(module).__name__} is not a kernel projection")
        for lin in linears:
            self._watch(lin._parameters, "weight", lin.weight)
            self._watch(lin._parameters, "bias", lin.bias)
        return linears

    def _float_proj(self, weights: list[Tensor], biases: list[Tensor | None], gated: bool,
                    keep: list | None = None) -> Proj:
        if not all(self.kernels.supports_weight(w) and w.dtype == self.dtype for w in weights):
            raise NotStackable("a float weight the kernels cannot take in this dtype")
        if any(b is not None and (b.dtype != self.dtype or not b.is_contiguous()) for b in biases):
            raise NotStackable("a bias of another dtype")
        n = len(weights)
        ws = (P * n)(*(w.data_ptr() for w in weights))
        bs = (P * n)(*(None if b is None else b.data_ptr() for b in biases))
        ns = (ctypes.c_int64 * n)(*(w.shape[0] for w in weights))
        (self.keep if keep is None else keep).extend([ws, bs, ns, weights, biases])
        self._last_float = (weights, biases, gated)
        out = weights[0].shape[0] if gated else sum(w.shape[0] for w in weights)
        return Proj(ctypes.addressof(ws), ctypes.addressof(bs), ctypes.addressof(ns), 0, n, 0, int(gated), out)

    # a setup: the cache and the adapter columns of a step ------------------------------------------------------
    def configure(self, kv: DenseKVCache | PagedStepView) -> bool:
        """Make the next step read and write `kv` with the adapter columns the mix names: one sequence's
        adapter (one slot) or one row of per-adapter weights (X-LoRA), whose per-column weights are filled
        in here. False for several rows of weights, which the module path runs; NotStackable for a cache
        the step cannot take."""
        mix = self.adapters.mix
        if self.adapters.sync():
            self._setups.clear()
        state = StackAdapters.state(mix)
        if state is None:
            return False
        key = (_cache_id(kv), state)
        setup = self._setups.get(key)
        if setup is None or not setup.holds(kv):
            setup = self._make_setup(kv, state)
            if setup is None:
                return False
            self._setups = {k: s for k, s in self._setups.items() if s.kv_ref() is not None and k != key}
            if len(self._setups) >= SETUPS:
                del self._setups[next(iter(self._setups))]
            self._setups[key] = setup
        if setup is not self._setup:
            self._use(setup)
        if setup.paged is not None:
            self.set_row(kv)
        if setup.scales is not None:  # this token's weight of every column
            torch.index_select(mix.weights.reshape(-1).to(self.dtype).float(), 0, setup.scale_index,
                               out=setup.scales)
        return True

    def premerge(self, slot: int) -> None:
        """Merge a merge=True adapter's weight copies now rather than in the first step that runs it (X-LoRA
        calls this in the call that freezes its mix)."""
        if self.adapters.sync():
            self._setups.clear()
        self.adapters.premerge(slot)

    def _use(self, setup: "_Setup") -> None:
        self.layers, self.step.layers = setup.layers, ctypes.addressof(setup.layers)
        self.step.cold_bits, self.step.cold_bs, self.step.cold_max_blocks = setup.cold
        self.step.scratch, self.step.max_len = setup.scratch.data_ptr(), setup.max_len
        self.step.lora_h = setup.lora_h.data_ptr()
        self.step.paged = None if setup.paged is None else ctypes.addressof(setup.paged)
        self.step.q = None if setup.q is None else setup.q.data_ptr()
        self.kv, self._setup = setup.kv_ref(), setup  # the step's cache, held while it is the current one

    def _make_setup(self, kv: DenseKVCache | PagedStepView, state: tuple) -> "_Setup | None":
        if len(kv.keys) != len(self.base_layers) or len(kv.values) != len(self.base_layers):
            raise NotStackable("the cache has another number of layers")
        if isinstance(kv, PagedStepView):
            setup = self._paged_setup(kv)
            return setup if self.adapters.set_columns(setup, state) else None
        shape = (1, self.kv_heads, kv.max_len, self.head_dim)
        for k, v in zip(kv.keys, kv.values):
            if any(t.shape != shape or t.dtype != self.dtype or not t.is_cpu or not t.is_contiguous() for t in (k, v)):
                raise NotStackable("the cache is not one contiguous sequence of the step's dtype")
        layers = (Layer * len(self.base_layers))()
        ctypes.memmove(layers, self.base_layers, ctypes.sizeof(layers))
        two_tier = isinstance(kv, TwoTierDenseKVCache)
        for i, (k, v) in enumerate(zip(kv.keys, kv.values)):
            layers[i].keys, layers[i].values = k.data_ptr(), v.data_ptr()
            layers[i].cold = ColdTier.of(kv.codes[i], 0, 0) if two_tier else ColdTier()  # counts: the step's
        tier = layers[0].cold
        groups = self.heads // self.kv_heads
        scratch = torch.empty(self.kv_heads * ((groups + 1) * self.head_dim + kv.max_len), dtype=torch.float32)
        setup = _Setup(kv, layers, (kv.quant.bits if two_tier else 0, tier.bs, tier.max_blocks), scratch)
        return setup if self.adapters.set_columns(setup, state) else None

    def _paged_setup(self, view: PagedStepView) -> "_Setup":
        """The layers pointed at a paged cache's blocks (and cold pool); each step then sets its row (set_row)."""
        _, block_size, kv_heads, head_dim = view.keys[0].shape
        if (kv_heads, head_dim) != (self.kv_heads, self.head_dim) or head_dim % 8 or head_dim > MAX_HEAD_DIM \
                or self.heads // kv_heads * max(head_dim, block_size) > MAX_GROUP_FLOATS:  # paged.c's bounds
            raise NotStackable("the paged cache's heads or block size do not fit the kernel")
        kv_dtype = view.keys[0].dtype  # the model's, or --kv-cache-dtype fp16 / bf16 (paged.c widens it)
        for k, v in zip(view.keys, view.values):
            if any(t.shape != view.keys[0].shape or t.dtype != kv_dtype or kv_dtype not in KV_TYPES or not t.is_cpu
                   or not t.is_contiguous() for t in (k, v)):
                raise NotStackable("the paged cache is not fp32, bf16 or fp16 of one dtype, contiguous, on the CPU")
        layers = (Layer * len(self.base_layers))()
        ctypes.memmove(layers, self.base_layers, ctypes.sizeof(layers))
        for i, (k, v) in enumerate(zip(view.keys, view.values)):
            layers[i].keys, layers[i].values = k.data_ptr(), v.data_ptr()
            cold = view.cold[i] if view.cold is not None else None
            layers[i].cold = ColdTier(*(t.data_ptr() for t in cold), 0, 0, 0, 0) if cold else ColdTier()
        setup = _Setup(view, layers, (0, 0, 0), torch.empty(head_dim, dtype=torch.float32))
        setup.row = (ctypes.c_int64 * 3)(0, 0, 0)  # the row's sequence and token (0), then its n_cold
        setup.length = (ctypes.c_int64 * 1)(0)
        setup.paged = PagedDecode(seqs=ctypes.addressof(setup.row), tokens=ctypes.addressof(setup.row),
                                  lens=ctypes.addressof(setup.length), rows=1, H=self.heads, KV=kv_heads, D=head_dim,
                                  bs=block_size, bf16=int(self.dtype == torch.bfloat16), bits=view.bits,
                                  kv=KV_TYPES[kv_dtype])
        setup.q = torch.empty(self.heads * head_dim, dtype=self.dtype)
        return setup

    def set_row(self, view: PagedStepView) -> None:
        """This step's table, length, cold count and slot (a paged setup, the current one)."""
        setup = self._setup
        setup.view, setup.table = view, view.table  # kept: C reads the table during the step
        setup.paged.tables, setup.paged.table_stride = view.table.data_ptr(), view.table.numel()
        setup.length[0], setup.row[2], self.step.slot = view.length, view.n_cold, view.slot
        setup.paged.n_cold = ctypes.addressof(setup.row) + 16 if view.n_cold else None
        self.kv = view

    # running it ---------------------------------------------------------------------------------------------
    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, position: int) -> Tensor:
        """x [1, 1, hidden] (the embedding, updated in place) -> final-normed hidden states [1, 1, hidden]."""
        paged = isinstance(self.kv, PagedStepView)
        if paged and position != self.kv.length - 1:
            raise ValueError(f"position {position} is not the paged step's last ({self.kv.length - 1})")
        if not paged and position >= self.kv.max_len:
            raise ValueError(f"position {position} does not fit a cache of max_len {self.kv.max_len}")
        out = torch.empty_like(x)
        self.step.cold_tokens = 0 if paged else getattr(self.kv, "settled", 0)  # tokens read from codes (two-tier)
        status = self._fn(ctypes.byref(self.step), x.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[-1],
                          position, out.data_ptr())
        if status != 0:
            raise RuntimeError(f"rk_decode_step failed in layer {-status - 1} at position {position}")
        return out


class _Setup:
    """One (cache, adapter state) a step may run with: a copy of the layer array pointing at the cache and
    the adapters' columns, and what those pointers need alive."""

    def __init__(self, kv: DenseKVCache | PagedStepView, layers, cold: tuple[int, int, int], scratch: Tensor) -> None:
        self.layers, self.cold, self.scratch = layers, cold, scratch
        self.max_len = 0 if isinstance(kv, PagedStepView) else kv.max_len
        self.paged: PagedDecode | None = None  # a paged cache's: the row set per step (StackPlan.set_row)
        self.q: Tensor | None = None  # a paged cache's rotated queries
        self.view = kv if isinstance(kv, PagedStepView) else None  # the paged step last set
        # weak: a finished generation's cache goes with its backend, not kept alive by the plan (a new
        # LLM.generate makes a new cache); its setup then never matches and is dropped with the next new one.
        # A paged cache is the engine's for its life: the setup names its latest step's view.
        self.kv_ref = weakref.ref(kv) if self.view is None else (lambda: self.view)
        self.key_refs, self.value_refs = [weakref.ref(t) for t in kv.keys], [weakref.ref(t) for t in kv.values]
        self.lora_h = torch.empty(1)  # step.c's A x, as long as the largest rank set
        self.scales: Tensor | None = None  # weights: each column's weight this step (lora_t.scale)
        self.scale_index: Tensor | None = None  # weights: each column's index into the flattened row of weights
        self.keep: list = []

    def holds(self, kv: DenseKVCache | PagedStepView) -> bool:
        """Whether the setup points at `kv`'s tensors (the ones it holds now)."""
        same = (kv.keys is self.view.keys if isinstance(kv, PagedStepView) and self.view is not None
                else kv is self.kv_ref())
        return (same and all(k is ref() for k, ref in zip(kv.keys, self.key_refs))  # operator.call: 3.11+
                and all(v is ref() for v, ref in zip(kv.values, self.value_refs)))


def _cache_id(kv: DenseKVCache | PagedStepView) -> int:
    """A cache's identity: a paged step's view is new every step, its keys list is the cache's own."""
    return id(kv.keys) if isinstance(kv, PagedStepView) else id(kv)


def _get(layer: nn.Module, name: str) -> nn.Module | None:
    return layer._modules.get(name)


def _down_in(mlp: nn.Module | None) -> int:
    down = None if mlp is None else mlp._modules.get("down_proj")
    if down is None:
        raise NotStackable("no down projection")
    return down.in_features


def _quant_plan(module: nn.Module):
    """(the QuantPlan the module's forward runs on the CPU, its parts or [] for a single layer), or None
    for float modules. Raises NotStackable for a quantized one without a current plan."""
    from ..quant.linear import QuantLinear  # quant imports models: not at import time

    if isinstance(module, QuantLinear):
        plan, parts = module.__dict__.get("_plan"), []
    elif isinstance(module, FusedLinear) and any(isinstance(p, QuantLinear) for p in module.parts):
        plan, parts = module.__dict__.get("_quant_plan"), list(module.parts)
        stale = plan is not None and (len(plan.key) != len(parts)
                                      or any(a is not p._token for a, p in zip(plan.key, parts)))
        plan = None if stale else plan  # built for parts that have moved since
    else:
        return None
    if plan is None or plan.perm is not None:  # rk_decode_step passes x as it is: no act-order gather
        raise NotStackable("a quantized projection has no current CPU plan, or reads x permuted (act-order)")
    return plan, parts


class KernelDecoderModel(DecoderModel):
    """DecoderModel whose decode steps of one sequence run as one rk_decode_step call."""

    kernels: CpuKernels
    stack_enabled = True
    _stack: StackPlan | None = None
    _stack_failed: tuple | None = None  # (kv, dtype) a layout was refused for: not retried every step

    def forward(self, input_ids: Tensor, positions: Tensor, kv=None) -> Tensor:
        if self._wants_rows(input_ids, positions, kv):  # a speculative step's k + 1 rows: one call (stack_rows.py)
            hidden = self._rows_forward(input_ids, positions, kv)
            if hidden is not None:
                return hidden
        target = self._target(input_ids, kv)  # the dense cache, or a paged single-sequence step
        stack = self._usable_stack(input_ids, target)
        if stack is None:
            hidden = super().forward(input_ids, positions, kv)
            if self._wants_stack(input_ids, target, hidden.dtype, rows=True):
                self._lay_out(target, hidden.dtype)  # the step above built every module's plan
            return hidden
        x = self.embed_tokens(input_ids)  # [1, 1, hidden], a new tensor: the step updates it in place
        if self.embedding_multiplier != 1.0:
            x = x * torch.tensor(self.embedding_multiplier, dtype=x.dtype)
        cos, sin = self.rotary_emb(positions, x.dtype)  # [1, 1, rot]
        if isinstance(target, TwoTierDenseKVCache):
            kv.settle(int(positions))  # the blocks leaving the hot window turn cold before the step reads them
        with stack.lock:  # one step at a time: the work rows and the bound cache are the plan's
            try:
                if not stack.configure(target):  # several rows of adapter weights (X-LoRA batches): the module path
                    return super().forward(input_ids, positions, kv)
            except NotStackable:
                self._stack_failed = (_cache_id(target), stack.dtype)
                return super().forward(input_ids, positions, kv)
            return stack(x.contiguous(), cos.contiguous(), sin.contiguous(), int(positions))

    def _wants_rows(self, input_ids: Tensor, positions: Tensor, kv) -> bool:
        """Several rows of one sequence at consecutive positions over a dense cache without a cold tier."""
        rows = input_ids.shape[-1]
        return (self.stack_enabled and self._stack is not None and type(kv) is DenseKVCache and input_ids.dim() == 2
                and input_ids.shape[0] == 1 and 2 <= rows <= ROWS_MAX and not input_ids.is_cuda
                and not torch.is_grad_enabled() and int(positions[0, -1]) == int(positions[0, 0]) + rows - 1)

    def _rows_forward(self, input_ids: Tensor, positions: Tensor, kv: DenseKVCache) -> Tensor | None:
        """Final-normed hidden states [1, T, hidden] from one rk_rows_step call; None: the module path."""
        stack = self._stack
        if not stack.valid() or self._stack_failed == (_cache_id(kv), stack.dtype):
            return None
        step = stack.rows_step()
        if step is None:
            return None
        x = self.embed_tokens(input_ids)  # [1, T, hidden]
        if self.embedding_multiplier != 1.0:
            x = x * torch.tensor(self.embedding_multiplier, dtype=x.dtype)
        if x.dtype != stack.dtype:
            return None
        cos, sin = self.rotary_emb(positions, x.dtype)  # [1, T, rot]
        with stack.lock:
            try:
                if not stack.configure(kv):
                    return None
            except NotStackable:
                self._stack_failed = (_cache_id(kv), stack.dtype)
                return None
            return step(x.contiguous(), cos.contiguous(), sin.contiguous(), int(positions[0, 0]))

    def prepare_adapter(self, slot: int) -> None:
        """Do now what the first one-call step with adapter `slot` would do first (merge a merge=True one)."""
        stack = self._stack
        if stack is not None and stack.valid():
            with stack.lock:
                stack.premerge(slot)

    @staticmethod
    def _target(input_ids: Tensor, kv) -> DenseKVCache | PagedStepView | None:
        """What a one-call step would run on: a DenseKVCache, or the view of a paged cache's step that is one
        sequence decoding one token (native_server's PagedKVStep.decode_view; None for any other step)."""
        if isinstance(kv, DenseKVCache):
            return kv
        view = getattr(kv, "decode_view", None)
        return view() if view is not None and input_ids.shape == (1, 1) else None

    def _wants_stack(self, input_ids: Tensor, kv, dtype: torch.dtype, rows: bool = False) -> bool:
        """Whether a one-call step fits (rows: or a rows step over a dense cache, to lay the plan out after)."""
        one = input_ids.shape == (1, 1) or (rows and type(kv) is DenseKVCache and input_ids.shape[0] == 1
                                            and input_ids.shape[-1] <= ROWS_MAX)
        return (self.stack_enabled and isinstance(kv, (DenseKVCache, PagedStepView)) and one
                and dtype in DTYPES and not input_ids.is_cuda and not torch.is_grad_enabled()
                and self._stack_failed != (_cache_id(kv), dtype))

    def _usable_stack(self, input_ids: Tensor, kv) -> StackPlan | None:
        stack = self._stack
        if stack is None or not self._wants_stack(input_ids, kv, stack.dtype):
            return None
        if not stack.valid():
            self._stack = None
            return None
        return stack

    def _lay_out(self, kv: DenseKVCache | PagedStepView, dtype: torch.dtype) -> None:
        try:
            self._stack = StackPlan(self, self.kernels, dtype, kv)
        except NotStackable:
            self._stack, self._stack_failed = None, (_cache_id(kv), dtype)

    def _apply(self, fn, recurse: bool = True):
        self._stack = None  # .to() and friends: lay out again from the moved tensors
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict:
        """For copy.deepcopy and pickling: the plan (ctypes pointers, a lock) is laid out again on use."""
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        return {**state, "_stack": None, "_stack_failed": None}
