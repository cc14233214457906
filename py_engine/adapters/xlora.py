"""X-LoRA inference, equal to peft's XLoraModel (eval mode), with a KV cache.

    xlm = load_xlora(model, "path/to/xlora")          # what XLoraModel.save_pretrained wrote
    kv = DenseKVCache.allocate(config, 1, 256, layers=xlm.kv_layers)
    logits = xlm(input_ids, positions, kv)            # [B, T, V], like CausalLM
    xlm.last_scalings                                 # [B, T, n_lora_layers, n_experts]

Each forward is peft's two passes:
1. the scaling pass: every LoRA layer applies each expert times `scaling_pass_value`
   (0 by default: the base model) and the classifier reads the final hidden state (after
   the final norm, transformers' `hidden_states[-1]`): scalings [B, T, L, E], a softmax
   over the experts at `softmax_temperature`, one row per LoRA layer with
   `layerwise_scalings`, else the same row broadcast to all L;
2. the real pass: LoRA layer l adds sum_e w[t, l, e] * scaling_e * B_e A_e x, where w
   keeps each token's `top_k_lora` largest scalings (re-normalised by a softmax over
   those k with `enable_softmax_topk`) times `global_scaling_weight`.

peft's generate() runs without a cache and recomputes the whole sequence every step. Both
passes are causal, so each keeps its own KV cache here (as mistral.rs does): the cache
holds 2 x num_hidden_layers layers, the real pass's first, the scaling pass's after, and
decoding one token costs two one-token passes instead of two whole-sequence passes.

`non_granular=k` (mistral.rs's `tgt_non_granular_index`): the first k forward calls of a
sequence (the prompt, then k - 1 generated tokens) compute scalings per token; every later
call reuses the last token's scalings from call k and skips the scaling pass, so decoding
then costs about what one LoRA pass costs. A call starting at position 0 starts a new
sequence; the state is the model's, so this mode serves one sequence at a time.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor, nn

from ..models.kv_cache import DenseKVCache
from .checkpoint import LoraAdapter, LoraModule, load_lora
from .config import AdapterError, LoraConfig
from .manager import LoraManager
from .xlora_config import XLoraConfig

__all__ = ["XLoraClassifier", "XLoraModel", "load_xlora", "select_scalings"]

_CLASSIFIER_KEY = re.compile(r"(?:.*\.)?internal_xlora_classifier\.layers\.(\d+)\.(weight|bias)$")


class XLoraClassifier(nn.Module):
    """peft's XLoraClassifier in eval mode: Linear (ReLU Linear)* from the final hidden state."""

    def __init__(self, config: XLoraConfig, n_layers: int, n_experts: int, state: dict[str, Tensor]) -> None:
        super().__init__()
        self.config, self.n_layers, self.n_experts = config, n_layers, n_experts
        indices = sorted({int(k.split(".")[1]) for k in state})  # "layers.N.weight": N counts ReLUs too
        if len(indices) != config.xlora_depth:
            raise AdapterError(f"{config.path}: the classifier has {len(indices)} linear layers, xlora_depth says "
                               f"{config.xlora_depth}")
        out = n_experts * (n_layers if config.layerwise_scalings else 1)
        sizes = [config.hidden_size] + [config.xlora_size] * (config.xlora_depth - 1) + [out]
        self.linears = nn.ModuleList()
        for i, index in enumerate(indices):
            w, b = state.get(f"layers.{index}.weight"), state.get(f"layers.{index}.bias")
            if w is None or b is None or tuple(w.shape) != (sizes[i + 1], sizes[i]) or tuple(b.shape) != (sizes[i + 1],):
                got = "missing" if w is None or b is None else f"{list(w.shape)} + bias {list(b.shape)}"
                raise AdapterError(f"{config.path}: classifier layer {index} should be [{sizes[i + 1]} x {sizes[i]}] "
                                   f"with a bias, got {got} ({n_layers} LoRA layers x {n_experts} experts; "
                                   "a classifier for another base model or other experts?)")
            linear = nn.Linear(sizes[i], sizes[i + 1])
            with torch.no_grad():
                linear.weight.copy_(w)
                linear.bias.copy_(b)
            self.linears.append(linear)

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [B, T, hidden] -> scalings [B, T, n_layers, n_experts]."""
        B, T, _ = hidden.shape
        x = hidden.to(self.linears[0].weight.dtype)
        for i, linear in enumerate(self.linears):
            x = linear(x)
            if i < len(self.linears) - 1:
                x = torch.relu(x)
        if self.config.layerwise_scalings:
            x = x.reshape(B, T, self.n_layers, self.n_experts)  # [B, T, L, E]
        else:
            x = x[:, :, None, :].expand(B, T, self.n_layers, self.n_experts)  # [B, T, L, E]
        if self.config.enable_softmax:
            x = torch.softmax(x / self.config.softmax_temperature, dim=-1)
        return x


def select_scalings(scalings: Tensor, config: XLoraConfig) -> Tensor:
    """peft's XLoraLayer.get_maybe_topk_scalings for every layer at once: [..., E] -> [..., E]."""
    if config.top_k_lora is not None:
        _, top = torch.topk(scalings, k=config.top_k_lora, dim=-1)
        mask = torch.zeros_like(scalings, dtype=torch.bool).scatter_(-1, top, True)
        scalings = scalings * mask.to(scalings.dtype)
    if config.enable_softmax_topk:
        kept = scalings != 0
        scalings = torch.softmax(scalings.masked_fill(~kept, float("-inf")), dim=-1).masked_fill(~kept, 0.0)
    return scalings


class XLoraModel(nn.Module):
    """A CausalLM with X-LoRA: forward(input_ids, positions, kv=None, last_only=, logit_indices=) -> logits."""

    def __init__(self, lm: nn.Module, config: XLoraConfig, experts: list[LoraAdapter],
                 classifier_state: dict[str, Tensor], non_granular: int | None = None) -> None:
        super().__init__()
        if non_granular is not None and (not isinstance(non_granular, int) or non_granular < 1):
            raise ValueError(f"non_granular must be a positive number of forward calls, got {non_granular!r}")
        if config.hidden_size != lm.config.hidden_size:
            raise AdapterError(f"{config.path}: the X-LoRA classifier reads hidden size {config.hidden_size}, "
                               f"this model's is {lm.config.hidden_size} (an X-LoRA model for another base)")
        self.lm, self.xlora_config, self.non_granular = lm, config, non_granular
        self.config = lm.config  # what callers of a CausalLM read (perplexity, the backends)
        for adapter in experts:  # peft's XLoraModel cannot load these (its key rewriting breaks on the head)
            if any(name.rpartition(".")[2] == "lm_head" for name in adapter.modules):
                raise AdapterError(f"{adapter.path}: this X-LoRA expert adapts lm_head, which peft's XLoraModel "
                                   "cannot load either (no reference to be equal to); retrain it without lm_head")
        manager = getattr(lm, "lora", None) or LoraManager(lm)
        self.manager = manager
        self.experts = experts
        self.expert_slots = [manager.add(f"xlora:{name}", adapter) for name, adapter in zip(config.expert_names, experts)]
        self.n_layers = len(manager.layer_names())
        weight = next(lm.parameters())
        self.classifier = XLoraClassifier(config, self.n_layers, len(experts), classifier_state).to(
            dtype=weight.dtype, device=weight.device)
        self.kv_layers = 2 * lm.config.num_hidden_layers  # the real pass's layers, then the scaling pass's
        self.last_scalings: Tensor | None = None  # [B, T, L, E]: the classifier's output, as peft's get_latest_scalings
        self.scalings_log: list[Tensor] | None = None  # set to [] to collect each call's last-token scalings [B, L, E]
        self._views: tuple | None = None
        self._calls, self._frozen = 0, None

    @property
    def expert_names(self) -> tuple[str, ...]:
        return self.xlora_config.expert_names

    def forward(self, input_ids: Tensor, positions: Tensor, kv=None, last_only: bool = False,
                logit_indices: Tensor | None = None) -> Tensor:
        real_kv, mix = self._prepare(input_ids, positions, kv)
        with self.manager.using(**mix):
            return self.lm(input_ids, positions, real_kv, last_only=last_only, logit_indices=logit_indices)

    @property
    def model(self):
        """CausalLM.model's role: the real pass's final hidden state [B, T, hidden] (both passes run and
        fill their caches; the server runs this for prompt chunks that sample nothing)."""
        return self._hidden

    def _hidden(self, input_ids: Tensor, positions: Tensor, kv=None) -> Tensor:
        real_kv, mix = self._prepare(input_ids, positions, kv)
        with self.manager.using(**mix):
            return self.lm.model(input_ids, positions, real_kv)

    def _prepare(self, input_ids: Tensor, positions: Tensor, kv) -> tuple[object, dict]:
        """The scaling pass (or the frozen scalings): (the real pass's cache, the manager's mix)."""
        real_kv, scaling_kv = self._split(kv)
        state = self.__dict__  # per-step state set without nn.Module.__setattr__'s checks (~10 us a step)
        if int(positions.min()) == 0:  # a new sequence
            state.update(_calls=0, _frozen=None)
            if FROZEN in self.manager.slots:
                self.manager.remove(FROZEN)
        B, T = input_ids.shape
        frozen = self._frozen is not None
        if frozen:  # non-granular, past its first k calls: no scaling pass
            scalings = self._frozen if B == T == 1 else self._frozen.expand(B, T, -1, -1)
        else:
            scalings = self.classifier(self._scaling_pass(input_ids, positions, scaling_kv))  # [B, T, L, E]
            state["_calls"] = self._calls + 1
            if self.non_granular is not None and self._calls >= self.non_granular:
                state["_frozen"] = scalings[:, -1:].clone()  # [B, 1, L, E]
                self._freeze_adapter()
        state["last_scalings"] = scalings
        if self.scalings_log is not None:
            self.scalings_log.append(scalings[:, -1].detach().clone())
        if frozen and FROZEN in self.manager.slots:
            return real_kv, {"adapter": FROZEN}
        return real_kv, {"weights": self._mix_weights(select_scalings(scalings, self.xlora_config))}

    def _freeze_adapter(self) -> None:
        """Frozen scalings are constants: fold them into one adapter (every expert's A stacked, each B times
        its weight), which the single-adapter paths run; the CPU's one-call decode step runs it merged into
        copies of the float weights (merge=True), made here, in the call that freezes."""
        if self._frozen.shape[0] != 1:  # one mix per row: the weights path
            return
        w = select_scalings(self._frozen, self.xlora_config)[0, 0] * self.xlora_config.global_scaling_weight  # [L, E]
        index = {name: i for i, name in enumerate(self.manager.layer_names())}
        modules = {}
        for name in sorted({n for adapter in self.experts for n in adapter.modules}):
            parts = [(adapter.modules[name], float(w[index[name], e])) for e, adapter in enumerate(self.experts)
                     if name in adapter.modules]
            modules[name] = LoraModule(torch.cat([m.A for m, _ in parts]),
                                       torch.cat([m.B * (m.scaling * x) for m, x in parts], dim=1), 1.0)
        rank = max(m.rank for m in modules.values())
        config = LoraConfig(path=f"{self.xlora_config.path} (frozen X-LoRA mix)", r=rank, lora_alpha=rank)
        try:
            slot = self.manager.add(FROZEN, LoraAdapter(config, modules), merge=True)
        except AdapterError:  # above the manager's rank limit: keep the weights path
            return
        prepare = getattr(self.lm.model, "prepare_adapter", None)  # the CPU step merges it now, not in the next step
        if prepare is not None:
            prepare(slot)

    def _scaling_pass(self, input_ids: Tensor, positions: Tensor, kv) -> Tensor:
        """The final hidden state [B, T, hidden] with every expert at scaling_pass_value (0: the base model)."""
        value = self.xlora_config.scaling_pass_value
        if value == 0:  # peft adds B A (x * 0): exactly the base output
            with self.manager.using(None):
                return self.lm.model(input_ids, positions, kv)
        B, T = input_ids.shape
        dummy = torch.full((B, T, self.n_layers, len(self.expert_slots)), float(value),
                           dtype=self.classifier.linears[0].weight.dtype, device=input_ids.device)
        with self.manager.using(weights=self._mix_weights(select_scalings(dummy, self.xlora_config))):
            return self.lm.model(input_ids, positions, kv)

    def _mix_weights(self, scalings: Tensor) -> Tensor:
        """[B, T, L, E] selected scalings -> the manager's per-row weights: [N, S] or [N, L, S] (layerwise)."""
        B, T, L, E = scalings.shape
        scalings = scalings * self.xlora_config.global_scaling_weight
        if self.xlora_config.layerwise_scalings:
            weights = scalings.new_zeros(B * T, L, self.manager.num_slots)
            weights[:, :, self.expert_slots] = scalings.reshape(B * T, L, E)
        else:  # every layer has the same row: the cheaper shared form
            weights = scalings.new_zeros(B * T, self.manager.num_slots)
            weights[:, self.expert_slots] = scalings[:, :, 0].reshape(B * T, E)
        return weights

    def _split(self, kv):
        """(the real pass's cache, the scaling pass's): the first and second half of a 2L-layer cache."""
        if kv is None:
            return None, None
        L = self.lm.config.num_hidden_layers
        if not isinstance(kv, DenseKVCache):  # any cache with attend(layer, ...): the scaling pass is offset by L
            return kv, _ShiftedKV(kv, L)
        if len(kv.keys) != 2 * L:
            raise ValueError(f"X-LoRA keeps a second KV cache for its scaling pass: allocate {2 * L} layers "
                             f"(DenseKVCache.allocate(..., layers=model.kv_layers)), not {len(kv.keys)}")
        views = self._views  # the same view objects while kv is unchanged (the CPU decode step binds to them)
        if views is None or views[0] is not kv or views[1] is not kv.keys[0] or views[2] is not kv.keys[L]:
            views = (kv, kv.keys[0], kv.keys[L], DenseKVCache(kv.keys[:L], kv.values[:L]),
                     DenseKVCache(kv.keys[L:], kv.values[L:]))
            self._views = views
        return views[3], views[4]

    def token_weights(self, log: list[Tensor] | None = None) -> list[dict[str, float]]:
        """Each logged call's last-token weights per expert (mean over LoRA layers), labelled: the weights
        behind each generated token when `scalings_log` was set to [] before generating."""
        labels = self.xlora_config.expert_labels
        rows = [s[0].mean(dim=0).tolist() for s in (self.scalings_log if log is None else log)]  # [E] per call
        return [{label: round(w, 6) for label, w in zip(labels, row)} for row in rows]

    def single_expert(self, index: int) -> nn.Module:
        """Expert `index` alone as plain LoRA (weight 1, no classifier): a CausalLM-like module."""
        return _OneAdapter(self.lm, self.manager, f"xlora:{self.expert_names[index]}")


FROZEN = "xlora:frozen"  # the manager's name for the non-granular mode's folded adapter


class _ShiftedKV:
    """A cache seen from layer `offset` on: the scaling pass's half of a cache of 2L layers."""

    def __init__(self, kv, offset: int) -> None:
        self.kv, self.offset = kv, offset

    def attend(self, layer: int, *args, **kwargs) -> Tensor:
        return self.kv.attend(layer + self.offset, *args, **kwargs)


class _OneAdapter(nn.Module):
    def __init__(self, lm: nn.Module, manager: LoraManager, name: str) -> None:
        super().__init__()
        self.lm, self.manager, self.name, self.config = lm, manager, name, lm.config

    def forward(self, *args, **kwargs) -> Tensor:
        with self.manager.using(self.name):
            return self.lm(*args, **kwargs)


# loading ------------------------------------------------------------------------------------------------

def load_xlora(lm: nn.Module, folder: str | Path, non_granular: int | None = None,
               max_rank: int | None = None) -> XLoraModel:
    """An X-LoRA folder onto a loaded CausalLM (optionally already carrying LoRA adapters)."""
    folder = Path(folder)
    config = XLoraConfig.from_dir(folder)
    rank_limit = max_rank if max_rank is not None else getattr(getattr(lm, "lora", None), "max_rank", None)
    classifier = _classifier_state(folder)
    experts = [_load_expert(folder, i, saved, rank_limit) for i, (_, saved) in enumerate(config.experts)]
    return XLoraModel(lm, config, experts, classifier, non_granular)


def _classifier_state(folder: Path) -> dict[str, Tensor]:
    """`layers.N.weight/bias` of the classifier from the folder's adapter_model file."""
    from .checkpoint import _read_tensors

    state = {}
    for key, tensor in _read_tensors(folder).items():
        m = _CLASSIFIER_KEY.match(key)
        if m is None:
            raise AdapterError(f"{folder}: {key!r} is not an X-LoRA classifier weight")
        state[f"layers.{m.group(1)}.{m.group(2)}"] = tensor.float()
    if not state:
        raise AdapterError(f"{folder}: the X-LoRA classifier's weights are missing (adapter_model.safetensors "
                           "holds none; peft 0.20 and 0.21 save X-LoRA without them: save with peft <= 0.19)")
    return state


def _load_expert(folder: Path, index: int, saved: str, max_rank: int | None) -> LoraAdapter:
    """Expert `index`: peft's saved copy `folder/index/` when present, else the path the config names
    (relative to the folder)."""
    kwargs = {} if max_rank is None else {"max_rank": max_rank}
    copy = folder / str(index)
    if copy.is_dir():
        return _load_saved_copy(copy, **kwargs)
    path = Path(saved)
    path = path if path.is_absolute() else folder / path
    if not path.is_dir():
        raise AdapterError(f"{folder}: LoRA expert {index} is neither in {copy} nor at {path} (its `adapters` "
                           "entry)")
    return load_lora(path, **kwargs)


def _load_saved_copy(folder: Path, **kwargs) -> LoraAdapter:
    """XLoraModel.save_pretrained's copy of expert i: peft keeps every tensor whose name contains ".i."
    (other experts' lora_A.j, the base model's layer i), and expert i's own as `<module>.lora_A.weight`;
    only those are read, as peft's loader does."""
    from .checkpoint import _read_tensors

    config = LoraConfig.from_dir(folder, **kwargs)
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, tensor in _read_tensors(folder).items():
        for which in ("A", "B"):
            suffix = f".lora_{which}.weight"
            if key.endswith(suffix):
                name = key[: -len(suffix)]
                for prefix in ("base_model.lora_model.model.", "base_model.model."):
                    name = name.removeprefix(prefix)
                pairs.setdefault(name, {})[which] = tensor
    modules = {}
    for name, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"} or pair["A"].shape[0] != pair["B"].shape[1]:
            raise AdapterError(f"{folder}: module {name!r} lacks a matching lora_A/lora_B pair")
        r = pair["A"].shape[0]
        if r != config.rank(name):
            raise AdapterError(f"{folder}: module {name!r} has rank {r} but adapter_config.json says "
                               f"{config.rank(name)}")
        modules[name] = LoraModule(pair["A"].float().contiguous(), pair["B"].float().contiguous(),
                                   config.scaling(name, r))
    if not modules:
        raise AdapterError(f"{folder}: the expert holds no lora_A/lora_B tensors")
    return LoraAdapter(config, modules)
