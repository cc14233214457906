"""Quantized stand-ins for `nn.Linear`: the model code calls them exactly as it calls a Linear.

    layer = QuantLinear.from_weight(quantize_rtn(linear.weight, 4, 128, False), linear.bias)
    y = layer(x)  # x [..., K] -> y [..., N], in x's dtype
    w8a8 = W8A8Linear.from_float(linear)  # SmoothQuant: int8 weights and int8 activations per token

A layer holds its weight in the kernels' layout (kernels.PackedWeight, half a
byte per 4-bit code); `.qweight` unpacks the `QuantizedWeight` it was built
from, byte for byte, for the checkpoint writer and the ONNX exporter. The
forward runs the fastest kernel for the device (kernels.py); the
dequantize-then-matmul `reference_forward` is the MPS fallback and the oracle
every kernel is tested against.

An act-order GPTQ layer (hf_packing.act_order_perm) holds its codes over the
input channels in the order `perm`, W[:, perm], where its groups are
contiguous, so every kernel takes it unchanged; the layer reads x[..., perm]
(y = x[..., perm] @ W[:, perm]^T). `perm` is None for every other layer.
`dequantize()` gives W in its own column order; `.qweight` the permuted codes.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ggml import GGMLWeight
from .kernels import PackedWeight, QuantPlan, cpu_kernels_for, cpu_plan_fits, fake_quantize_rows
from .rtn import QuantizedWeight, quantize_rtn


class QuantLinear(nn.Module):
    """y = x @ dequantize(W)^T + b for a weight stored as integer codes in groups."""

    per_row = False  # W8A8Linear: x is rounded to int8 per row too
    kernels = None  # set by use_cpu_kernels: TorchBackend then runs steps in kernel_step (its forward needs none)
    _int8_activations = True

    def __init__(self, qweight: QuantizedWeight | PackedWeight | GGMLWeight, bias: Tensor | None = None,
                 perm: Tensor | None = None, *, consume: bool = False) -> None:
        """consume: qweight is not used after this (its 8-bit codes are packed in place). A PackedWeight is
        taken as it is (a GGUF file's Q4_0/Q4_1/Q8_0 blocks are that layout already: importers/gguf), and so is
        a GGMLWeight (a GGUF's Q5_0/Q5_1/K-quant blocks as the file holds them: quant/ggml.py)."""
        super().__init__()
        self.in_features, self.out_features = qweight.in_features, qweight.out_features
        if perm is not None and tuple(perm.shape) != (qweight.in_features,):
            raise ValueError(f"perm has shape {list(perm.shape)}, expected [{qweight.in_features}]")
        # act-order: the codes' column j is W's column perm[j] (not saved in state_dict: the codes are not either)
        self.register_buffer("perm", None if perm is None else perm.to(torch.int64), persistent=False)
        if isinstance(qweight, (PackedWeight, GGMLWeight)):
            self.packed = qweight
        else:
            self.packed = PackedWeight.pack(qweight, consume) if PackedWeight.packable(qweight) else None
        self._raw = None if self.packed is not None else qweight  # a layout no kernel takes (groups of 16)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._plan: QuantPlan | None = None  # built on the first CPU call
        self._device_weight: tuple | None = None  # torch's CUDA layout, made on first use
        self._token = object()  # renewed when the tensors move: fused plans over this layer check it

    @classmethod
    def from_weight(cls, qweight: QuantizedWeight, bias: Tensor | None = None,
                    perm: Tensor | None = None) -> "QuantLinear":
        return cls(qweight, bias) if perm is None else cls(qweight, bias, perm)  # W8A8Linear takes no perm

    @property
    def qweight(self) -> QuantizedWeight:
        """The QuantizedWeight (on the CPU) this layer was built from: with `perm`, that of W[:, perm]
        (its dequantize() is W with its columns in the order perm; the layer's own dequantize() is W)."""
        return self._raw if self.packed is None else self.packed.unpack()

    @property
    def int8_activations(self) -> bool:
        """On the CPU every count of rows rounds x to int8 per 32 values and multiplies in integers, each
        output summed in one order (quant.c, qtile.c, qpanel.c): a row gets the same bits alone or in a
        prompt chunk. False multiplies the dequantized codes by x in fp32 (exact, ~2x slower in decode)."""
        return self._int8_activations

    @int8_activations.setter
    def int8_activations(self, enabled: bool) -> None:
        if enabled != self._int8_activations:
            self._int8_activations, self._plan, self._token = enabled, None, object()

    @property
    def kernel_mode(self) -> int:
        if self.per_row:
            return QuantPlan.INT8_ROWS
        return QuantPlan.INT8_BLOCKS if self.int8_activations else QuantPlan.EXACT

    @property
    def bits(self) -> int:
        return self.qweight.bits if self.packed is None else self.packed.bits

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales, zero points, bias and an act-order perm."""
        q = self.packed or self._raw
        weight = q.nbytes if self.packed is not None else sum(
            t.numel() * t.element_size() for t in (q.codes, q.scales, q.zero_points, q.offsets) if t is not None)
        extra = sum(t.numel() * t.element_size() for t in (self.bias, self.perm) if t is not None)
        return weight + extra

    def dequantize(self) -> Tensor:
        """W as float32 [N, K] in its own column order (an act-order perm undone), on the layer's device."""
        w = self._raw.dequantize() if self.packed is None else dequantize_packed(self.packed)
        return original_order(w, self.perm)

    def __getstate__(self) -> dict:
        """For copy.deepcopy and pickling: the kernel plan (ctypes pointers) is rebuilt on first use."""
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = {**state, "_plan": None, "_device_weight": None}
        state.pop("kernels", None)
        return state

    def _apply(self, fn, recurse: bool = True):
        """.to(device) moves the codes (and perm, a buffer); .to(dtype) leaves scales in float32 (the bias
        follows it) and perm int64."""
        device = fn(torch.zeros(1)).device
        if self.packed is not None and self.packed.codes.device != device:
            self.packed = self.packed.to(device)
        self._plan, self._device_weight, self._token = None, None, object()
        return super()._apply(fn, recurse)

    def forward(self, x: Tensor) -> Tensor:
        plan = self._plan
        if plan is not None and x.dtype in _KERNEL_DTYPES and x.is_cpu and not _grad(x):  # decode: ~6 us a call
            return plan(x)
        kernels = cpu_kernels_for(x)
        if kernels is not None and self.packed is not None and cpu_plan_fits([self.packed], [self.bias]):
            self._plan = QuantPlan(kernels, [self.packed], [self.bias], self.kernel_mode, self.perm)
            return self._plan(x)
        if x.is_cuda and not self.per_row:
            y = _cuda_forward(self, x)
            if y is not None:
                return y
        xr = fake_quantize_rows(x).to(x.dtype) if self.per_row else x
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(xr, self.dequantize().to(device=x.device, dtype=x.dtype), bias)  # W: x as it is

    def extra_repr(self) -> str:
        q = self.packed or self._raw
        if isinstance(q, GGMLWeight):
            return (f"in_features={self.in_features}, out_features={self.out_features}, ggml={q.type_name}, "
                    f"bias={self.bias is not None}")
        group = f"group={q.block_size}" if q.block_size < q.in_features else "per-channel"
        zero = "sym" if q.symmetric else "float-min" if q.offsets is not None else "asym"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={q.bits}, {group}, "
                f"{zero}{', act-order' if self.perm is not None else ''}, "
                f"bias={self.bias is not None}")


class W8A8Linear(QuantLinear):
    """SmoothQuant's W8A8: int8 weights per output channel (symmetric) and x rounded to int8 per
    token (d = max|x| / 127), multiplied in integers on the CPU; y = d * s * (q_x . q_w) + b."""

    per_row = True

    def __init__(self, qweight: QuantizedWeight, bias: Tensor | None = None) -> None:
        if qweight.bits != 8 or qweight.blocks != 1 or not bool((qweight.zero_points == 128).all()):
            raise ValueError("W8A8 takes 8-bit symmetric weights with one scale per output channel")
        super().__init__(qweight, bias)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "W8A8Linear":
        return cls(quantize_rtn(linear.weight, 8, None, True), linear.bias)


def set_int8_activations(model: nn.Module, enabled: bool) -> int:
    """Choose the decode path of every QuantLinear in model (see QuantLinear.int8_activations);
    W8A8 layers always round x. Returns how many layers changed."""
    count = 0
    for m in model.modules():
        if isinstance(m, QuantLinear) and not m.per_row and m.int8_activations != enabled:
            m.int8_activations = enabled
            count += 1
    return count


def original_order(w: Tensor, perm: Tensor | None) -> Tensor:
    """W [N, K] from the act-order W[:, perm] (column j is W's column perm[j]); w itself when perm is None."""
    if perm is None:
        return w
    return w.new_empty(w.shape).index_copy_(1, perm.to(w.device), w)


def dequantize_packed(p: PackedWeight | GGMLWeight) -> Tensor:
    """(q - z) * s (+ offset) as float32 [N, K] on the codes' device (QuantizedWeight.dequantize's arithmetic)."""
    if isinstance(p, GGMLWeight):
        return p.dequantize()
    n = p.codes.shape[0]
    if p.bits <= 4:
        c = p.codes.view(n, -1, 1, 16)  # [N, nb, 1, 16]
        q = torch.cat([c & 15, c >> 4], dim=2).reshape(n, -1).float()  # [N, nb * 32]
    else:
        q = p.codes.view(torch.int8).float() + 128.0
    blocks = p.scales.shape[1]
    q = q[:, : blocks * p.block_size].view(n, blocks, p.block_size)  # [N, blocks, block]
    w = (q - p.zero_points.float()[:, :, None]) * p.scales[:, :, None]
    if p.offsets is not None:
        w = w + p.offsets[:, :, None]
    return w.reshape(n, -1)[:, : p.in_features]


@torch.no_grad()
def reference_forward(layer: QuantLinear, x: Tensor) -> Tensor:
    """Dequantize-then-matmul in float32 (x rounded per token first for W8A8): what every kernel must match."""
    bias = None if layer.bias is None else layer.bias.float()
    xr = fake_quantize_rows(x) if layer.per_row else x.float()
    return F.linear(xr, layer.dequantize().to(x.device), bias)


def fused_forward(module: nn.Module, parts: list[nn.Module], x: Tensor) -> Tensor:
    """QuantLinears that read the same x as one kernel call where they share a layout and an act-order
    perm (the plan gathers x[..., perm] once); else one by one. The plan is cached on `module` (a FusedLinear)."""
    plan = getattr(module, "_quant_plan", None)
    if (plan is not None and x.dtype in _KERNEL_DTYPES and x.is_cpu and not _grad(x)
            and all(a is p._token for a, p in zip(plan.key, parts))):  # decode: the cached call
        return plan(x)
    return _fused_slow(module, parts, x)


def gated_forward(module: nn.Module, x: Tensor) -> Tensor | None:
    """F.silu(gate(x)) * up(x) for a FusedLinear of two quantized parts [gate, up] in one kernel call
    (the MLP's hidden layer); None when its parts cannot run that way."""
    plan = getattr(module, "_quant_plan", None)
    if (plan is not None and x.dtype in _KERNEL_DTYPES and x.is_cpu and not _grad(x) and len(plan.key) == 2
            and plan.key[0] is module.parts[0]._token and plan.key[1] is module.parts[1]._token):
        return plan(x, gated=True)  # decode: the cached call
    parts = list(module.parts)
    if (len(parts) != 2 or not all(isinstance(p, QuantLinear) for p in parts)
            or parts[0].out_features != parts[1].out_features):
        return None
    if x.dtype not in _KERNEL_DTYPES or not x.is_cpu or _grad(x):
        return None
    fresh = lambda plan: plan is not None and all(a is p._token for a, p in zip(plan.key, parts))  # noqa: E731
    if not fresh(getattr(module, "_quant_plan", None)):
        _fused_slow(module, parts, x.reshape(-1, x.shape[-1])[:1])  # plans them where the kernels take them
        if not fresh(getattr(module, "_quant_plan", None)):
            return None
    return module._quant_plan(x, gated=True)


def _fused_slow(module: nn.Module, parts: list[nn.Module], x: Tensor) -> Tensor:
    quant = all(isinstance(p, QuantLinear) and p.packed is not None for p in parts)
    if quant and len({p.kernel_mode for p in parts}) == 1 and _same_perm(parts):
        kernels = cpu_kernels_for(x)
        if kernels is not None and cpu_plan_fits([p.packed for p in parts], [p.bias for p in parts]):
            key = [p._token for p in parts]
            plan = getattr(module, "_quant_plan", None)
            if plan is None or plan.key != key:  # first call, or a part moved
                plan = QuantPlan(kernels, [p.packed for p in parts], [p.bias for p in parts], parts[0].kernel_mode,
                                 parts[0].perm)
                plan.key = key
                module._quant_plan = plan
            return plan(x)
    return torch.cat([p(x) for p in parts], dim=-1)


def _same_perm(parts: list[QuantLinear]) -> bool:
    """Whether the parts read x in one order: none act-order, or all the same perm (q/k/v of an act-order
    checkpoint share one when their g_idx are equal, as their Hessians are)."""
    first = parts[0].perm
    if first is None:
        return all(p.perm is None for p in parts)
    return all(p.perm is not None and (p.perm is first or torch.equal(p.perm, first)) for p in parts)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _grad(x: Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def _cuda_forward(layer: QuantLinear, x: Tensor) -> Tensor | None:
    """The Triton kernel, else torch's CUDA weight-only kernels where the layout fits; None to dequantize."""
    p = layer.packed
    if p is None or x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or layer._device_weight == ():
        return None
    try:
        if layer._device_weight is None:
            layer._device_weight = _cuda_layout(p, x.dtype) or ()
        if not layer._device_weight:
            return None
        kind, w, extra = layer._device_weight
        x2 = x.reshape(-1, x.shape[-1])
        if layer.perm is not None:  # act-order: the codes' column order
            x2 = x2.index_select(-1, layer.perm.to(x.device))
        if kind == "triton":
            y = w(x2, p)
        elif kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2, w, extra.to(x.dtype))
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2.to(torch.bfloat16), w, p.block_size, extra).to(x.dtype)
        y = y.reshape(*x.shape[:-1], -1)
        return y if layer.bias is None else y + layer.bias.to(x.dtype)
    except (RuntimeError, NotImplementedError) as error:  # an op this torch build lacks: dequantize from now on
        warnings.warn(f"CUDA quantized matmul unavailable ({error}); dequantizing instead", stacklevel=2)
        layer._device_weight = ()
        return None


def _cuda_layout(p: PackedWeight, dtype: torch.dtype) -> tuple | None:
    """The Triton kernel (py_engine/gpu/quant_matmul.py: every packed layout, in place) where Triton
    runs, else torch's (torch_cuda_layout)."""
    from ..gpu import triton_problem

    if triton_problem(p.codes.device) is None:
        try:
            if isinstance(p, GGMLWeight):  # the file's blocks, decoded in the kernel
                from ..gpu.ggml_matmul import ggml_matmul
                return "triton", ggml_matmul, None
            from ..gpu.quant_matmul import quant_matmul
            return "triton", quant_matmul, None
        except Exception as error:  # noqa: BLE001 - a broken Triton install: torch's kernels instead
            warnings.warn(f"Triton quantized matmul unavailable ({error}); using torch's", stacklevel=3)
    return torch_cuda_layout(p)


def torch_cuda_layout(p: PackedWeight) -> tuple | None:
    """("int8", int8 [N, K], scales) or ("int4", torch's int4 tiles, [K / g, N, 2] scales and zeros)
    (w = (q - 8) s + zero) for torch's CUDA kernels; None where neither takes the layout."""
    if isinstance(p, GGMLWeight):
        return None
    q = PackedWeight.unpack(p)
    codes, k = q.codes.to(p.codes.device), p.in_features
    if p.bits == 8 and q.blocks == 1 and q.offsets is None and bool((q.zero_points == 128).all()):
        w = (codes[:, :k].to(torch.int16) - 128).to(torch.int8).contiguous()
        return "int8", w, q.scales[:, 0].to(codes.device)
    if p.bits <= 4 and p.block_size in (32, 64, 128, 256) and k % p.block_size == 0 and k % 128 == 0:
        pairs = codes[:, :k].to(torch.uint8)
        packed = (pairs[:, ::2] << 4 | pairs[:, 1::2]).contiguous()  # [N, K / 2]
        w = torch.ops.aten._convert_weight_to_int4pack(packed, 8 if k % 256 == 0 else 4)
        s = q.scales.to(codes.device)  # [N, groups]
        zero = (8.0 - q.zero_points.to(codes.device).float()) * s
        if q.offsets is not None:  # Q4_1's float minimum: w = (q - 8) s + (8 s + m)
            zero = zero + q.offsets.to(codes.device)
        extra = torch.stack([s, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [groups, N, 2]
        return "int4", w, extra
    return None
