"""The LoRA / X-LoRA side of a StackPlan (stack.py): which adapter columns each projection of a step reads.

A LoraLinear's base is laid out as any projection (stack.py), and before each step `set_columns` points its Proj
at the fp32 A and B^T of the adapter the model's AdapterMix names (one slot: the sequence's), which step.c adds
as y += B (A x). X-LoRA's per-token weights (one row: [1, S] or [1, L, S]) point every projection at all loaded
adapters' columns and fill one buffer of per-column weights per step (one index_select, in StackPlan.configure),
which step.c applies as y += B (w * (A x)); so both of X-LoRA's passes run on the one-call path. Several rows of
weights (the server's batches) take the module path. An adapter added with `merge=True` (X-LoRA's frozen
non-granular mix: one sequence, constant weights) runs merged: its delta is added once into per-sequence copies
of the float base weights it touches (up to MERGE_LIMIT bytes of copies), so its steps cost the base model's;
quantized projections keep the unmerged columns.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..adapters.layer import AdapterMix, LoraLinear, StackColumns
from .step_layout import Lora, NotStackable, Proj

if TYPE_CHECKING:
    from .stack import StackPlan, _Setup

MERGE_LIMIT = 512 << 20  # bytes of merged weight copies a merge=True adapter may take, else it runs unmerged


class StackAdapters:
    """The adapters of one StackPlan: the projections they wrap, the columns and merged copies made for them."""

    def __init__(self, plan: "StackPlan") -> None:
        self.plan = plan  # its float_parts, _float_proj and dtype: what merged copies are made from and as
        self.mix: AdapterMix | None = None
        self.loras: list[tuple[int, str, LoraLinear]] = []  # (layer, Proj field, wrapper): adapters set per step
        self._version: int | None = None  # the mix version the columns below were made for
        self._lora_structs: dict[tuple[int, int | None], tuple[Lora, StackColumns] | None] = {}
        self._merged: dict[tuple[int, str, int], tuple[Proj, list]] = {}  # (layer, field, slot) -> merged Proj
        self._merge_bufs: dict[tuple[int, str, int, int], tuple[Tensor, Tensor]] = {}  # its weights' memory

    def add(self, i: int, field: str, wrapper: LoraLinear) -> None:
        """Projection `field` of layer i is a LoraLinear: its adapters are set per step."""
        if self.mix is not None and wrapper.mix is not self.mix:
            raise NotStackable("projections of one model follow different adapter mixes")
        self.mix = wrapper.mix
        self.loras.append((i, field, wrapper))

    def sync(self) -> bool:
        """Forget the columns and merges of adapters that were added or removed since (mix.version); True
        when that happened (the plan then drops its setups too)."""
        mix = self.mix
        if mix is not None and mix.version != self._version:
            self._lora_structs.clear()
            self._merged.clear()
            self._merge_bufs = {k: v for k, v in self._merge_bufs.items() if k[3] in mix.merge_slots}
            self._version = mix.version
            return True
        return False

    def premerge(self, slot: int) -> None:
        """Merge a merge=True adapter's weight copies now rather than in the first step that runs it (X-LoRA
        calls this in the call that freezes its mix)."""
        if self.mix is not None and slot in self.mix.merge_slots and self._merge_fits(slot):
            for i, field, wrapper in self.loras:
                if (i, field) in self.plan.float_parts:
                    self._merged_proj(i, field, wrapper, slot)

    @staticmethod
    def state(mix: AdapterMix | None) -> tuple | None:
        """What the adapter columns of a step depend on: ("slot", slot) (-1: none) or ("weights", shape);
        None when this step cannot take the mix (several rows)."""
        if mix is None:
            return ("slot", -1)
        w = mix.weights
        if w is not None:
            return ("weights", tuple(w.shape)) if w.shape[0] == 1 and w.dim() in (2, 3) else None
        if mix.rows is not None:
            return ("slot", int(mix.rows[0])) if mix.rows.numel() == 1 else None
        return ("slot", -1 if mix.slot is None else mix.slot)

    def set_columns(self, setup: "_Setup", state: tuple) -> bool:
        """Point each adapted Proj of the setup's layers at its columns for `state`: one slot's (merged into
        copies of the weights for a merge slot), or every slot's, each column reading its weight from
        setup.scales at setup.scale_index of a row of weights [S] or [L, S] (flattened)."""
        kind, value = state
        slot = value if kind == "slot" else None
        if slot == -1:
            return True
        merged = slot is not None and slot in self.mix.merge_slots and self._merge_fits(slot)
        found = []  # (layer, field, its columns)
        for i, field, wrapper in self.loras:
            if merged and (i, field) in self.plan.float_parts:
                proj = self._merged_proj(i, field, wrapper, slot)
                if proj is not None:
                    setattr(setup.layers[i], field, proj)
                continue
            entry = self._lora_struct(wrapper, slot)
            if entry is not None:
                found.append((i, field, entry))
        if kind == "weights":
            index, S = [], value[-1]
            for _, _, (_, cols) in found:
                if len(value) == 3 and bool((cols.layer < 0).any()):
                    return False  # a segment without its layer index: the module path says why
                index.append(cols.layer * S + cols.slot if len(value) == 3 else cols.slot)
            setup.scale_index = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
            setup.scales = torch.empty(setup.scale_index.numel())
        offset, largest = 0, 0
        for i, field, (lora, _) in found:
            if setup.scales is not None:  # a Lora per setup: its scale pointer is the setup's
                lora = Lora(lora.A, lora.Bt, lora.r, lora.lo, lora.hi, setup.scales.data_ptr() + 4 * offset)
                setup.keep.append(lora)
            getattr(setup.layers[i], field).lora = ctypes.addressof(lora)
            offset, largest = offset + lora.r, max(largest, lora.r)
        setup.lora_h = torch.empty(max(largest, 1))
        return True

    def _lora_struct(self, wrapper: LoraLinear, slot: int | None) -> tuple[Lora, StackColumns] | None:
        key = (id(wrapper), slot)
        if key not in self._lora_structs:
            cols = wrapper.stack_columns(slot)
            self._lora_structs[key] = None if cols is None else (
                Lora(cols.A.data_ptr(), cols.Bt.data_ptr(), cols.A.shape[0], cols.lo.data_ptr(), cols.hi.data_ptr(),
                     None), cols)
        return self._lora_structs[key]

    def _merge_fits(self, slot: int) -> bool:
        """Whether copies of the float weights a merge slot's adapter touches fit MERGE_LIMIT."""
        size = sum(w.numel() * w.element_size() for i, field, wrapper in self.loras
                   if (i, field) in self.plan.float_parts and slot in wrapper.entries
                   for w in self.plan.float_parts[(i, field)][0])
        return size <= MERGE_LIMIT

    def _merged_proj(self, i: int, field: str, wrapper: LoraLinear, slot: int) -> Proj | None:
        """The float projection (layer i, field) with the slot's adapter merged into copies of its weights:
        W + scaling B A, accumulated in fp32 and rounded once to the dtype (None: the adapter leaves it
        alone). Costs rank x weights multiply-adds (a few ms for the built-in model), once per sequence."""
        key = (i, field, slot)
        if key not in self._merged:
            segments = wrapper.entries.get(slot)
            if not segments:
                self._merged[key] = None
            else:
                weights, biases, gated = self.plan.float_parts[(i, field)]
                merged, row = [], 0
                for p, w in enumerate(weights):  # each part (q, k, v; gate, up), plus the segments reaching its rows
                    end, work, out = row, *self._merge_buffers(i, field, p, slot, w)
                    end += w.shape[0]
                    reach = [(m, max(row, off), min(end, off + wrapper.splits[seg]), off) for seg, m in segments.items()
                             for off in [wrapper.offsets[seg]] if max(row, off) < min(end, off + wrapper.splits[seg])]
                    if len(reach) == 1 and reach[0][1:3] == (row, end) and w.dtype == torch.float32:
                        m, a, b, off = reach[0]  # one segment covers the part: W + s B A in one pass over W
                        torch.addmm(w, m.B[a - off:b - off], m.A, alpha=m.scaling, out=work)
                    else:
                        work.copy_(w)
                        for m, a, b, off in reach:
                            work[a - row:b - row].addmm_(m.B[a - off:b - off], m.A, alpha=m.scaling)
                    if out is not work:
                        out.copy_(work)
                    merged.append(out)
                    row = end
                keep: list = []
                self._merged[key] = (self.plan._float_proj(merged, biases, gated, keep), keep)
        entry = self._merged[key]
        return None if entry is None else entry[0]

    def _merge_buffers(self, i: int, field: str, part: int, slot: int, w: Tensor) -> tuple[Tensor, Tensor]:
        """(fp32 work, result in the dtype) for one merged part, kept from sequence to sequence: a slot's
        next merge (X-LoRA's next frozen mix) writes the same memory instead of faulting in fresh pages,
        which took longer than the merge's arithmetic."""
        key = (i, field, part, slot)
        bufs = self._merge_bufs.get(key)
        if bufs is None or bufs[0].shape != w.shape:
            with torch.inference_mode(False):  # normal tensors: the next merge may run outside inference mode
                work = torch.empty(w.shape, dtype=torch.float32)
                bufs = self._merge_bufs[key] = (work, work if self.plan.dtype == torch.float32 else torch.empty_like(w))
        return bufs
