"""`LoraManager`: load LoRA adapters into a model by name and choose which apply to each row.

    manager = LoraManager(model)                 # also reachable as model.lora
    manager.add("sonnets", "path/to/adapter")    # or a LoraAdapter; checked whole before anything changes
    manager.set_adapter_mix(adapter="sonnets")   # every row; None for the base
    manager.set_adapter_mix(indices=[0, 0, -1])  # a slot per flattened row (manager.slot(name)), -1: base
    manager.set_adapter_mix(weights=w)           # [rows, slots] or [rows, layers, slots] (X-LoRA's scalings)
    with manager.using("sonnets"): logits = model(ids, positions, kv)

Adapters name the base model's modules (peft's `model.layers.0.self_attn.q_proj`).
The model may have been transformed since it was loaded (py_engine.cpu's
fuse_projections turns q/k/v into one `qkv_proj` FusedLinear): a q_proj
adapter then becomes the first segment of that fused projection. Each
projection an adapter touches is wrapped once in a `LoraLinear`; with no
adapter active it returns the base output unchanged.

`layer_names()` lists every adapted segment in peft's module order (the
order XLoraModel numbers its layers in, for layerwise scalings):
`set_layer_order(names)` overrides it.
"""
from __future__ import annotations

import re
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import Tensor, nn

from .checkpoint import LoraAdapter, load_lora
from .config import DEFAULT_MAX_RANK, AdapterError
from .layer import AdapterMix, LoraLinear, projection_splits

# A base model's separate projection -> (the fused module our transforms make, its segment).
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# Module order inside a decoder layer as transformers builds it (peft numbers LoRA layers in this order).
_ORDER = ["q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj"]
_PHI3_ORDER = ["o_proj", "qkv_proj", "gate_up_proj", "down_proj"]  # Phi3Attention defines o_proj first


class LoraManager:
    """The adapters loaded into one model, their slots, and the mix the next forward applies."""

    def __init__(self, model: nn.Module, max_loras: int | None = None, max_rank: int = DEFAULT_MAX_RANK) -> None:
        if getattr(model, "lora", None) is not None:
            raise ValueError("this model already has a LoraManager (model.lora)")
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.config = getattr(model, "config", None)
        self.mix = AdapterMix()
        self.adapters: dict[str, LoraAdapter] = {}
        self.slots: dict[str, int] = {}
        self._order: list[str] | None = None
        self.lock = threading.RLock()  # held by using(): one forward's mix at a time
        object.__setattr__(model, "lora", self)

    def __getstate__(self) -> dict:  # copy.deepcopy of a model with adapters: a fresh lock in the copy
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, lock=threading.RLock())

    # adapters ---------------------------------------------------------------------------------------
    def add(self, name: str, adapter: LoraAdapter | str | Path, merge: bool = False) -> int:
        """Load an adapter under a name; return its slot. Nothing changes if it does not fit the model.
        merge: the CPU's one-call decode step may run it merged into copies of the float weights it touches
        (the same result within fp32 rounding, at the base model's speed, for one more copy of those weights)."""
        if name in self.slots:
            raise AdapterError(f"an adapter named {name!r} is already loaded")
        if self.max_loras is not None and len(self.slots) >= self.max_loras:
            raise AdapterError(f"{len(self.slots)} adapters are loaded, the limit (--max-loras) is {self.max_loras}")
        if not isinstance(adapter, LoraAdapter):
            adapter = load_lora(adapter, self.max_rank)
        elif adapter.max_rank > self.max_rank:
            raise AdapterError(f"{adapter.path}: rank {adapter.max_rank} is above the limit of {self.max_rank}")
        sharded = getattr(self.model, "tensor_parallel", None)  # py_engine.parallel: this rank's rows/columns
        if sharded is not None:
            adapter = sharded.shard_adapter(adapter)
        places = [(self._place(adapter, module_name), m) for module_name, m in adapter.modules.items()]
        self._check_targets(adapter)
        self._check_base_weights(adapter)
        slot = min(set(range(len(self.slots) + 1)) - set(self.slots.values()))
        for (parent, attr, segment), m in places:
            self._wrapper(parent, attr).add(slot, segment, m)
        self.adapters[name], self.slots[name] = adapter, slot
        if merge:
            self.mix.merge_slots.add(slot)
        self._number_layers()
        return slot

    def remove(self, name: str) -> None:
        slot = self.slots.pop(name, None)
        if slot is None:
            raise AdapterError(f"no adapter named {name!r} is loaded")
        del self.adapters[name]
        self.mix.merge_slots.discard(slot)
        for w in self.wrappers():
            w.remove(slot)
        self._number_layers()
        if self.mix.slot == slot:
            self.mix.slot = None

    def slot(self, name: str | None) -> int:
        """The slot of a loaded adapter; -1 for None (the base model)."""
        if name is None:
            return -1
        if name not in self.slots:
            raise AdapterError(f"no adapter named {name!r} is loaded (loaded: {sorted(self.slots) or 'none'})")
        return self.slots[name]

    @property
    def num_slots(self) -> int:
        """Size of the slot axis of `weights` in set_adapter_mix."""
        return max(self.slots.values(), default=-1) + 1

    def wrappers(self) -> list[LoraLinear]:
        return [m for m in self.model.modules() if isinstance(m, LoraLinear)]

    # the mix ------------------------------------------------------------------------------------------
    def set_adapter_mix(self, adapter: str | None = None, *, indices: Sequence[int] | Tensor | None = None,
                        weights: Tensor | None = None, head_indices: Sequence[int] | Tensor | None = None) -> None:
        """What the next forwards apply: one adapter by name (None: the base), a slot per flattened row
        (indices, -1 for the base), or per-row weights per slot ([rows, slots] or [rows, layers, slots]).
        head_indices: with indices, the slot of each row the LM head computes (when it computes a subset)."""
        if (adapter is not None) + (indices is not None) + (weights is not None) > 1:
            raise ValueError("set_adapter_mix takes one of adapter, indices or weights")
        mix = self.mix
        mix.slot = mix.rows = mix.weights = mix.head_rows = None
        mix.masks.clear()
        if adapter is not None:
            mix.slot = self.slot(adapter)
        elif indices is not None:
            rows = torch.as_tensor(indices, dtype=torch.long)
            if rows.dim() != 1:
                raise ValueError(f"indices must be one slot per row, got shape {list(rows.shape)}")
            mix.rows = rows
            if head_indices is not None:
                mix.head_rows = torch.as_tensor(head_indices, dtype=torch.long)
        elif weights is not None:
            if weights.shape[-1] != self.num_slots:
                raise ValueError(f"weights' last axis is {weights.shape[-1]}; {self.num_slots} slots are loaded")
            mix.weights = weights

    @contextmanager
    def using(self, adapter: str | None = None, **kwargs) -> Iterator[None]:
        """set_adapter_mix for the block, then back to the base. The mix is the model's: the block holds the
        manager's lock, so threads sharing one model (LLM.generate from several) take turns, each with its own."""
        with self.lock:
            self.set_adapter_mix(adapter, **kwargs)
            try:
                yield
            finally:
                self.set_adapter_mix(None)

    # layer numbering (X-LoRA) ------------------------------------------------------------------------
    def layer_names(self) -> list[str]:
        """Every adapted segment, named as in the base model, in peft's order (or set_layer_order's)."""
        names = [n for w in self.wrappers() for seg in w.segments_with_adapters() for n in [w.names[seg]]]
        if self._order is not None:
            return [n for n in self._order if n in set(names)]
        return sorted(names, key=self._peft_key)

    def set_layer_order(self, names: Sequence[str]) -> None:
        self._order = list(names)
        self._number_layers()

    def _number_layers(self) -> None:
        index = {n: i for i, n in enumerate(self.layer_names())}
        for w in self.wrappers():
            for seg, name in enumerate(w.names):
                w.set_layer_index(seg, index.get(name))

    def _peft_key(self, name: str) -> tuple:
        parts = name.split(".")
        layer = next((int(p) for p in parts if p.isdigit()), 1 << 30)  # the LM head comes after the layers
        leaf = parts[-1]
        order = _PHI3_ORDER if getattr(self.config, "model_type", None) == "phi3" else _ORDER
        return (layer, order.index(leaf) if leaf in order else len(order), name)

    # where an adapter's module lives ------------------------------------------------------------------
    def _place(self, adapter: LoraAdapter, name: str) -> tuple[nn.Module, str, int]:
        """(parent module, attribute, segment) computing the base model's module `name`; AdapterError if
        this model has no such projection or its shape differs (an adapter for another base)."""
        m = adapter.modules[name]
        base = adapter.config.base_model_name_or_path
        other = f" (the adapter was trained on {base!r})" if base else ""
        parent_name, _, leaf = name.rpartition(".")
        fused_names = bool(getattr(self.config, "fused_projections", False))
        if (leaf in FUSED and fused_names) or (leaf in ("qkv_proj", "gate_up_proj") and not fused_names):
            raise AdapterError(f"{adapter.path}: adapts {name!r}, which this model does not have{other}")
        try:
            parent = self.model.get_submodule(parent_name)
        except AttributeError:
            raise AdapterError(f"{adapter.path}: adapts {name!r}, which this model does not have{other}") from None
        attr, segment = leaf, 0
        if leaf not in parent._modules and leaf in FUSED and FUSED[leaf][0] in parent._modules:
            attr, segment = FUSED[leaf]
        module = parent._modules.get(attr)
        base_module = module.base if isinstance(module, LoraLinear) else module
        splits = None if base_module is None else projection_splits(base_module)
        if splits is None or segment >= len(splits):
            raise AdapterError(f"{adapter.path}: adapts {name!r}, which is not a linear layer of this model{other}")
        shape = (splits[segment], getattr(base_module, "in_features", None) or _in(base_module))
        if (m.B.shape[0], m.A.shape[1]) != shape:
            raise AdapterError(f"{adapter.path}: {name!r} is [{m.B.shape[0]} x {m.A.shape[1]}] in the adapter but "
                               f"[{shape[0]} x {shape[1]}] in this model: an adapter for another base model{other}")
        return parent, attr, segment

    def _check_targets(self, adapter: LoraAdapter) -> None:
        """Every target_modules entry must name a projection of this model, as peft matches them (a
        name: the module or a suffix after a dot; a string: a regex over whole names); peft refuses an
        adapter whose targets it cannot find, and so do we rather than load a config that lies."""
        targets = adapter.config.target_modules
        if not targets or targets == "all-linear":
            return
        names = self._projection_names()
        if isinstance(targets, str):
            try:
                found = any(re.fullmatch(targets, n) for n in names)
            except re.error as e:
                raise AdapterError(f"{adapter.path}: target_modules {targets!r} is not a valid regex ({e})") from None
            if not found:
                raise AdapterError(f"{adapter.path}: target_modules {targets!r} matches no module of this model")
            return
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            raise AdapterError(f"{adapter.path}: target_modules {', '.join(map(repr, missing[:5]))} name no module "
                               "of this model")

    def _projection_names(self) -> list[str]:
        """The base model's name of every linear projection (a fused one by the names of its parts)."""
        out = []
        for name, module in self.model.named_modules():
            base = module.base if isinstance(module, LoraLinear) else module
            splits = projection_splits(base)
            if splits is None:
                continue
            prefix, _, attr = name.rpartition(".")
            parts = [leaf for leaf, (fused, _) in FUSED.items() if fused == attr] if len(splits) > 1 else [attr]
            out += [f"{prefix}.{leaf}".lstrip(".") for leaf in parts]
        return out

    def _check_base_weights(self, adapter: LoraAdapter) -> None:
        """Whole embedding/head weights saved with the adapter must be this model's: a LoRA delta is all we add."""
        for name, saved in adapter.base_weights.items():
            try:
                module = self.model.get_submodule(name)
            except AttributeError:
                module = None
            module = module.base if isinstance(module, LoraLinear) else module
            if hasattr(module, "qweight"):  # a quantized head: its rounded codes cannot equal the float copy
                continue
            weight = getattr(module, "weight", None)
            if not isinstance(weight, Tensor) or tuple(weight.shape) != tuple(saved.shape) or not torch.equal(
                    saved.to(device=weight.device, dtype=weight.dtype), weight):
                raise AdapterError(f"{adapter.path}: the adapter saves its own {name} weight, which differs from this "
                                   "model's (a retrained embedding or head, or another base model); ruvllm applies "
                                   "LoRA deltas only")

    def _wrapper(self, parent: nn.Module, attr: str) -> LoraLinear:
        module = parent._modules[attr]
        if isinstance(module, LoraLinear):
            return module
        prefix = next(n for n, m in self.model.named_modules() if m is parent)
        splits = projection_splits(module)
        if len(splits) > 1:  # a fused projection: name its segments as the base model did
            leaves = [leaf for leaf, (fused, _) in FUSED.items() if fused == attr]
        else:
            leaves = [attr]
        wrapper = LoraLinear(module, splits, [f"{prefix}.{leaf}".lstrip(".") for leaf in leaves], self.mix)
        wrapper.is_head = parent is self.model and attr == "lm_head"
        parent._modules[attr] = wrapper
        return wrapper


def _in(module: nn.Module) -> int:
    parts = getattr(module, "parts", None)
    return int(parts[0].in_features) if parts is not None else int(module.in_features)
