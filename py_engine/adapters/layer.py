"""`LoraLinear`: a projection plus the LoRA deltas of any number of adapters, applied unmerged.

    y = base(x) + sum over adapters a of  w[row, a] * scaling_a * B_a (A_a x)

The wrapped module is whatever computes the projection (nn.Linear, the CPU
kernels' KernelLinear or FusedLinear, a QuantLinear): its output is left
untouched and the delta added after, so quantized and kernel bases take LoRA
with no change of their own. A fused projection (q/k/v as one `qkv_proj`,
gate/up as one `gate_up_proj`) has one *segment* per original projection and
each segment its own adapters, so an adapter trained on q_proj applies to the
first rows of the fused output only.

Which adapter applies to which row comes from the model's `AdapterMix`
(shared by all its LoraLinears, set through `LoraManager.set_adapter_mix`):
- nothing active: the base output, bit for bit;
- one adapter for every row: h = A_a x, delta = (B_a * scaling_a) h;
- a slot per row (token), -1 for the base: punica's gathered shrink/expand done
  as two dense matmuls over every loaded adapter's columns with a 0/1 mask on
  h [rows, R]: with a few adapters of small rank R is a few hundred columns,
  and rows of different adapters cost one batched matmul instead of a loop;
- a weight per row and adapter (X-LoRA's scalings): the mask becomes those
  weights, [rows, slots] shared by every layer, or [rows, layers, slots]
  where each segment reads its `layer_index` (peft's layerwise scalings).

All adapters' matrices are packed into A_all^T [in, R] and B_all^T [R, out]
(scaling folded into B, a segment's B rows outside its slice zero), with
each column's slot and layer index beside them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .checkpoint import LoraModule


@dataclass
class AdapterMix:
    """Which adapters the next forward applies (one per model; see LoraManager.set_adapter_mix).

    slot: one adapter slot for every row; rows: [N] slot per flattened row, -1 for the base;
    weights: [N, S] or [N, L, S] per-row weight of each slot (X-LoRA). At most one is set.
    head_rows: with rows, the slot of each row the LM head sees when it computes fewer rows than the
    decoder (the server's logit_indices: one row per sampling sequence)."""

    slot: int | None = None
    rows: Tensor | None = None
    weights: Tensor | None = None
    head_rows: Tensor | None = None
    # rows' 0/1 column masks, shared by the projections whose packed columns have the same slots (most of a
    # model's): one compare per layout and step instead of one per projection. Cleared when the mix changes.
    masks: dict = field(default_factory=dict)
    version: int = 0  # bumped when any LoraLinear of the model changes its adapters (stack.py rereads them)
    # slots the CPU decode step may run merged into per-sequence copies of the float weights (py_engine.cpu.stack;
    # X-LoRA's frozen non-granular mix): LoraManager.add(..., merge=True)
    merge_slots: set = field(default_factory=set)

    @property
    def active(self) -> bool:
        return self.slot is not None or self.rows is not None or self.weights is not None


@dataclass
class StackColumns:
    """LoRA columns of one projection for the CPU decode step: A [r, in], Bt = (scaling * B)^T [r, out] (zero
    outside each column's segment), and per column the rows lo..hi of the output it reaches, its slot and
    its layer index (-1: none)."""

    A: Tensor
    Bt: Tensor
    lo: Tensor
    hi: Tensor
    slot: Tensor
    layer: Tensor


class LoraLinear(nn.Module):
    """A projection with LoRA deltas; forward(x [..., in]) -> [..., out]."""

    def __init__(self, base: nn.Module, splits: list[int], names: list[str], mix: AdapterMix) -> None:
        super().__init__()
        self.base = base
        self.splits, self.names, self.mix = list(splits), list(names), mix
        self.offsets = [sum(splits[:i]) for i in range(len(splits))]
        self.layer_index: list[int | None] = [None] * len(splits)  # X-LoRA's layer number per segment
        self.entries: dict[int, dict[int, LoraModule]] = {}  # slot -> segment -> matrices
        self.is_head = False  # the model's LM head (reads AdapterMix.head_rows)
        self._packed: tuple[Tensor, Tensor, Tensor, Tensor, dict[int, tuple[Tensor, Tensor]]] | None = None
        self._layout: tuple[int, ...] = ()  # each packed column's slot (the key of AdapterMix.masks)

    @property
    def in_features(self) -> int:
        return _in_features(self.base)

    @property
    def out_features(self) -> int:
        return sum(self.splits)

    @property
    def weight(self) -> Tensor:
        """The base projection's weight (code that reads model.lm_head.weight.dtype keeps working)."""
        return self.base.weight

    def add(self, slot: int, segment: int, module: LoraModule) -> None:
        self.entries.setdefault(slot, {})[segment] = module
        self._changed()

    def remove(self, slot: int) -> None:
        if self.entries.pop(slot, None) is not None:
            self._changed()

    def _changed(self) -> None:
        self._packed = None
        self.mix.version += 1
        self.mix.masks.clear()

    def stack_columns(self, slot: int | None = None) -> "StackColumns | None":
        """One adapter's columns (or, for None, every loaded adapter's) as the CPU decode step reads them
        (kernels/step.c's lora_t), fp32 contiguous; None when they leave this projection alone."""
        slots = sorted(self.entries) if slot is None else [slot] if slot in self.entries else []
        As, Bts, lo, hi, col_slot, col_layer = [], [], [], [], [], []
        for s in slots:
            for seg, m in sorted(self.entries[s].items()):
                A, B = self._segment(seg, m)
                As.append(A.float())
                Bts.append(B.T.float())
                off, index = self.offsets[seg], self.layer_index[seg]
                lo += [off] * m.rank
                hi += [off + self.splits[seg]] * m.rank
                col_slot += [s] * m.rank
                col_layer += [-1 if index is None else index] * m.rank
        if not As:
            return None
        longs = [torch.tensor(v, dtype=torch.long) for v in (lo, hi, col_slot, col_layer)]
        return StackColumns(torch.cat(As).contiguous(), torch.cat(Bts).contiguous(), *longs)

    def _segment(self, seg: int, m: LoraModule) -> tuple[Tensor, Tensor]:
        """A [r, in] and B [out, r] of one segment's adapter, scaling folded in, zero outside its rows."""
        B = torch.zeros(self.out_features, m.rank)
        off = self.offsets[seg]
        B[off:off + self.splits[seg]] = m.B * m.scaling
        return m.A, B

    def segments_with_adapters(self) -> list[int]:
        return sorted({seg for per_slot in self.entries.values() for seg in per_slot})

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        mix = self.mix
        if not mix.active or not self.entries:
            return y
        shrunk = self._shrink(x, mix)
        if shrunk is None:  # the adapter(s) of this step leave this projection alone
            return y
        h, B_T = shrunk  # [N, r], [r, out]
        y2 = y.reshape(-1, y.shape[-1])
        if h.dtype != y.dtype:
            return (y2 + (h @ B_T).to(y.dtype)).view(y.shape)
        return torch.addmm(y2, h, B_T).view(y.shape)  # y + h B^T in one call: the expand

    def _shrink(self, x: Tensor, mix: AdapterMix) -> tuple[Tensor, Tensor] | None:
        """h = A x for the columns that apply, masked or weighted per row, and the B^T to expand it with."""
        A_T, B_T, col_slot, col_layer, per_slot = self._pack(x)
        x2 = x.reshape(-1, x.shape[-1])  # [N, in]
        if mix.slot is not None:
            pair = per_slot.get(mix.slot)
            if pair is None:
                return None
            return x2 @ pair[0], pair[1]  # [N, r], [r, out]
        h = x2 @ A_T  # [N, R]: every loaded adapter's shrink
        if mix.rows is not None:
            head = self.is_head and mix.head_rows is not None
            key = (self._layout, head, h.dtype, h.device)
            mask = mix.masks.get(key)
            if mask is None:
                rows = (mix.head_rows if head else mix.rows).to(col_slot.device)
                if rows.shape != (x2.shape[0],):
                    raise ValueError(f"adapter rows has shape {list(rows.shape)}; the forward has {x2.shape[0]} rows")
                mask = mix.masks[key] = (rows[:, None] == col_slot[None]).to(h.dtype)  # [N, R]
            return h.mul_(mask), B_T  # each row keeps its adapter's columns
        return h.mul_(self._column_weights(mix.weights, x2.shape[0], col_slot, col_layer).to(h.dtype)), B_T

    def _column_weights(self, w: Tensor, n: int, col_slot: Tensor, col_layer: Tensor) -> Tensor:
        w = w.to(col_slot.device)
        if w.dim() == 3:  # [N, L, S]: the layerwise weights of each column's segment
            if (col_layer < 0).any():
                raise ValueError(f"{self.names}: layerwise adapter weights need each segment's layer_index")
            w = w[:, col_layer, col_slot]  # [N, R]
        elif w.dim() == 2:  # [N, S]
            w = w[:, col_slot]  # [N, R]
        else:
            raise ValueError(f"adapter weights must be [rows, slots] or [rows, layers, slots], got {list(w.shape)}")
        if w.shape[0] != n:
            raise ValueError(f"adapter weights have {w.shape[0]} rows; the forward has {n}")
        return w

    def _pack(self, x: Tensor):
        """A_all^T [in, R], B_all^T [R, out] (scaled), each column's slot and layer, and each slot's own
        contiguous (A^T, B^T) for steps that run one adapter; in x's dtype and device, built on first use."""
        packed = self._packed
        if packed is not None and packed[0].device == x.device and packed[0].dtype == x.dtype:
            return packed
        As, Bs, slots, layers, per_slot = [], [], [], [], {}
        for slot in sorted(self.entries):
            first = len(slots)
            for seg, m in sorted(self.entries[slot].items()):
                A, B = self._segment(seg, m)
                As.append(A)
                Bs.append(B)
                slots += [slot] * m.rank
                index = self.layer_index[seg]
                layers += [-1 if index is None else index] * m.rank
            per_slot[slot] = (first, len(slots))
        A_T = torch.cat(As).T.contiguous().to(device=x.device, dtype=x.dtype)  # [in, R]
        B_T = torch.cat(Bs, dim=1).T.contiguous().to(device=x.device, dtype=x.dtype)  # [R, out]
        per_slot = {s: (A_T[:, a:b].contiguous(), B_T[a:b]) for s, (a, b) in per_slot.items()}
        col_slot = torch.tensor(slots, device=x.device)
        col_layer = torch.tensor(layers, device=x.device)
        self._layout = tuple(slots)
        self._packed = (A_T, B_T, col_slot, col_layer, per_slot)
        return self._packed

    def set_layer_index(self, segment: int, index: int | None) -> None:
        if self.layer_index[segment] != index:
            self.layer_index[segment] = index
            self._changed()


def _in_features(module: nn.Module) -> int:
    parts = getattr(module, "parts", None)
    if parts is not None:  # FusedLinear
        return _in_features(parts[0])
    return int(module.in_features)


def projection_splits(module: nn.Module) -> list[int] | None:
    """The output size of each projection a module computes, or None if it is not a projection."""
    parts = getattr(module, "parts", None)
    if parts is not None:
        return [int(p.out_features) for p in parts]
    if hasattr(module, "in_features") and hasattr(module, "out_features") and not isinstance(module, nn.Embedding):
        return [int(module.out_features)]
    return None
