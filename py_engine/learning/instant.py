"""The instant update, tuned for latency: one pattern's MicroLoRA on the last layer, trained on its pair only.

    trainer = InstantTrainer(model, config)
    lora, stats = trainer.train(example)     # ~ one frozen forward + a few ms of steps

Where the time goes, and what is cut (SmolLM2-135M, a 42-token chat prompt):
- The frozen forward: the base up to the last layer does not train, so it runs
  once, without gradients, over the prompt and the answer; the keys and values
  of the longest prefix it shares with a recent example (the chat template's
  system prompt) are reused (`PrefixKV`), so only the new tokens are computed.
  It runs on a bfloat16 copy of the model where the CPU has native bf16
  (`instant_dtype`): a pass over ~20 new tokens reads every weight once, so
  half the bytes is about half the time (SmolLM2: 2x; hidden states within
  ~3% of float32's, which the steps then take as their fixed input).
- The steps: the MicroLoRA sits on the last layer's o_proj / down_proj (and
  gate / up), whose inputs at the answer's positions the frozen pass kept, so a
  step is those few rows through the last layer's output half and the head, not
  the sequence through the model.
- The head: the loss is a softmax over the answer's tokens, the base's
  `CANDIDATES` likeliest tokens at each position (its real competitors) and
  the `NEAR` tokens whose head rows are nearest the answer token's (pushing z
  toward the answer lifts them too), not the 49152-word vocabulary; the full
  head checks the result once at the end.
- With a LoRA on down_proj alone (`micro_modules`, the default), nothing before
  down_proj changes, so its input rows are computed once and a step reads no
  weight of the model: the LoRA's own matrices and the candidates' head rows.
- Steps stop once every answer token is the argmax with probability >= 1/2
  (`micro_steps` is the most): one correction, one update.
Other target modules, or more than one layer, take the general path
(`train_lora` over the whole model).
"""
from __future__ import annotations

import contextlib
import copy
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import SonaConfig
from .lora import TrainableLora, applied
from .objective import Example
from .train import TrainStats, freeze, train_lora

Modules = dict[str, tuple[Tensor, Tensor, float]]

CANDIDATES = 256  # base-likeliest tokens per position the fast loss normalises over, beside the answer's
NEAR = 32  # tokens whose head rows are nearest each answer token's, also candidates: they rise with it
FAST_MODULES = {"o_proj", "gate_proj", "up_proj", "down_proj"}
PREFIXES_KEPT = 4
DONE_LOGPROB = -0.69  # log 1/2: each answer token the argmax with at least even odds


class PrefixKV:
    """A KV cache for one forward that starts from the kept keys and values of a prefix: [1, KV, P, D]
    per layer; records the whole sequence's for the next one."""

    def __init__(self, keys: list[Tensor] | None = None, values: list[Tensor] | None = None) -> None:
        self.prefix_k, self.prefix_v = keys, values
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, spec) -> Tensor:
        from py_engine.models.attention import attention

        if self.prefix_k is not None:
            k = torch.cat([self.prefix_k[layer], k], 2)  # [1, KV, P + T, D]
            v = torch.cat([self.prefix_v[layer], v], 2)
        self.keys[layer], self.values[layer] = k, v
        return attention(q, k, v, positions, torch.arange(k.shape[2]), spec)


@dataclass
class Captured:
    """What the frozen pass keeps at the answer's positions P ([N] rows): the last layer's input and its
    attention output before o_proj, and the base's logits there."""

    x: Tensor  # [N, hidden]
    attn: Tensor  # [N, q_dim]
    logits: Tensor  # [N, V] float32
    near: Tensor  # [N, V]: each answer token's head row against every row (what rises with it)


class InstantTrainer:
    def __init__(self, model: nn.Module, config: SonaConfig) -> None:
        self.model, self.config = model, config
        self.prefixes: OrderedDict[tuple[int, ...], tuple[list[Tensor], list[Tensor]]] = OrderedDict()
        last = model.model.layers[-1]
        self.fast = (config.micro_layers == 1 and set(config.micro_modules) <= FAST_MODULES
                     and not getattr(last, "sandwich", False) and not getattr(last, "moe", False)
                     and hasattr(last.self_attn, "o_proj") and model.config.final_logit_softcapping is None)
        self.dtype = frozen_dtype(config.instant_dtype, next(model.parameters()))
        self._frozen: nn.Module | None = None

    @property
    def frozen(self) -> nn.Module:
        """The model the frozen pass runs on: the model itself, or its copy in `self.dtype` (made once,
        without the forward hooks an adapter applied to the model when it was copied)."""
        if self.dtype == next(self.model.parameters()).dtype:
            return self.model
        if self._frozen is None:
            twin = copy.deepcopy(self.model)
            for module in twin.modules():
                module._forward_hooks.clear()
                module._forward_pre_hooks.clear()
            self._frozen = freeze(twin.to(self.dtype))
        return self._frozen

    def new_lora(self) -> TrainableLora:
        c = self.config
        return TrainableLora.for_model(self.model, c.micro_modules, c.micro_layers, c.micro_rank, c.micro_alpha,
                                       seed=c.seed)

    def train(self, example: Example, under: Modules | None = None) -> tuple[TrainableLora, TrainStats]:
        """A fresh MicroLoRA trained on this one example over `under` (the consolidated adapter: the
        caller has it hooked into the model already; the frozen copy gets it here)."""
        lora = self.new_lora()
        if not self.fast:
            return lora, train_lora(self.model, lora, [example], steps=self.config.micro_steps,
                                    lr=self.config.micro_lr)
        start = time.perf_counter()
        frozen = self.frozen
        with applied(frozen, under if frozen is not self.model else None):
            captured = self.frozen_pass(example)
        stats = self.fit(lora, captured, torch.tensor(example.target_ids))
        return lora, TrainStats(stats[0], stats[1], stats[2], time.perf_counter() - start)

    @torch.no_grad()
    def frozen_pass(self, example: Example) -> Captured:
        model = self.frozen
        seq = list(example.prompt_ids) + list(example.target_ids)
        n = len(example.target_ids)
        p = len(example.prompt_ids)
        rows = torch.arange(p - 1, p - 1 + n)  # position t predicts token t + 1
        keep, (pk, pv) = self._prefix(seq[:p])  # reused keys and values of the first `keep` tokens
        last = model.model.layers[-1]
        got: dict[str, Tensor] = {}
        hooks = [last.register_forward_pre_hook(lambda m, a: got.__setitem__("x", a[0])),
                 last.self_attn.o_proj.register_forward_pre_hook(lambda m, a: got.__setitem__("attn", a[0]))]
        cache = PrefixKV(pk, pv)
        try:
            ids = torch.tensor([seq[keep:]])
            hidden = model.model(ids, torch.arange(keep, len(seq))[None], cache)  # [1, T - keep, hidden]
        finally:
            for h in hooks:
                h.remove()
        self._remember(tuple(seq[:p]), cache)
        local = rows - keep
        head = model.lm_head
        queries = torch.cat([hidden[0, local], head.weight[torch.tensor(example.target_ids)]])  # [2N, hidden]
        both = head(queries).float()  # one read of the head for both: [2N, V]
        return Captured(got["x"][0, local].float(), got["attn"][0, local].float(), both[:n], both[n:])

    def fit(self, lora: TrainableLora, captured: Captured, targets: Tensor, *, steps: int | None = None,
            lr: float | None = None, keep: Any = None) -> tuple[int, float, float]:
        """Adam steps on the cut loss until each answer token wins; (steps, first loss, last loss).

        The cut softmax cannot see a token outside its candidates rising: whenever it says done, the full
        head checks, and the tokens that beat the answer there join the candidates (then training goes on).
        `keep` (consolidate.Keep): a term added to the loss that holds other rows' distributions."""
        model = self.model
        steps_most = max(1, steps if steps is not None else self.config.micro_steps)
        k = min(CANDIDATES, captured.logits.shape[-1])
        near = captured.near.topk(min(NEAR, captured.near.shape[-1]), -1).indices
        candidates = torch.cat([captured.logits.topk(k, -1).indices, near], 1)  # [N, k + NEAR]
        optimizer = torch.optim.Adam(lora.parameters(), lr=self.config.micro_lr if lr is None else lr)
        first = last_loss = float("nan")
        steps = 0
        head, labels = self._cut_head(targets, candidates)
        layer_out, attach = self._layer_out(lora, captured)
        held = keep.bind(self, lora) if keep is not None else None
        with attach, torch.enable_grad():
            for steps in range(1, steps_most + 1):
                z = model.model.norm(layer_out())
                cut = torch.einsum("nh,nch->nc", z, head).float() + self._mask  # [N, 1 + k]
                loss = F.cross_entropy(cut, labels)
                last_loss = float(loss.detach())
                first = last_loss if steps == 1 else first
                if bool((cut.detach().log_softmax(-1)[:, 0] >= DONE_LOGPROB).all()):
                    rivals = self._rivals(z.detach(), targets)
                    if rivals is None:
                        break
                    candidates = torch.cat([candidates, rivals], 1)
                    head, labels = self._cut_head(targets, candidates)
                if held is not None:
                    loss = loss + held()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        return steps, first, last_loss

    def _layer_out(self, lora: TrainableLora, captured: Captured) -> tuple[Callable[[], Tensor], Any]:
        """The last layer's output rows [N, hidden] as a function of the LoRA, and the context that
        attaches it. A LoRA on down_proj alone leaves everything before it fixed: down_proj's input rows
        and the layer's base output are computed once, and a step is the LoRA's scaling * B (A act) on
        them (no weight of the model read); otherwise a step runs the layer's output half."""
        last = self.model.model.layers[-1]
        if len(lora.names) == 1 and lora.names[0].endswith(".mlp.down_proj"):
            got: dict[str, Tensor] = {}
            hook = last.mlp.down_proj.register_forward_pre_hook(lambda m, a: got.__setitem__("act", a[0]))
            try:
                with torch.no_grad():
                    h = captured.x + last.self_attn.o_proj(captured.attn)
                    fixed = h + last.mlp(last.post_attention_layernorm(h))  # [N, hidden]
            finally:
                hook.remove()
            act = got["act"]  # [N, intermediate]
            A, B, scaling = lora.A[0], lora.B[0], lora.scaling
            return (lambda: fixed + scaling * F.linear(F.linear(act, A), B)), contextlib.nullcontext()

        def run() -> Tensor:
            h = captured.x + last.self_attn.o_proj(captured.attn)  # [N, hidden]
            return h + last.mlp(last.post_attention_layernorm(h))
        return run, lora.attached(self.model)

    def _cut_head(self, targets: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]:
        """The head rows of [answer, candidates...] per position ([N, 1 + k, hidden]; label 0), and a mask
        (-inf) on a candidate that is the answer itself, so it counts once."""
        ids = torch.cat([targets[:, None], candidates], 1)
        mask = torch.zeros(ids.shape)
        mask[:, 1:][candidates == targets[:, None]] = float("-inf")
        self._mask = mask
        return self.model.lm_head.weight.detach()[ids], torch.zeros(len(targets), dtype=torch.long)

    @torch.no_grad()
    def _rivals(self, z: Tensor, targets: Tensor, count: int = 16) -> Tensor | None:
        """None when the full head agrees (every answer token its argmax with even odds); else each
        position's `count` likeliest tokens, to join the candidates."""
        head = self.frozen.lm_head
        logp = head(z.to(head.weight.dtype)).float().log_softmax(-1)  # [N, V]
        if bool((logp.argmax(-1) == targets).all()) and \
                bool((logp.gather(1, targets[:, None]) >= DONE_LOGPROB).all()):
            return None
        return logp.topk(count, -1).indices

    def _prefix(self, prompt: Sequence[int]) -> tuple[int, tuple[list[Tensor] | None, list[Tensor] | None]]:
        """The longest kept prefix of `prompt` (never all of it: the last prompt token is computed, since
        its row is needed) and its keys and values."""
        best, found = 0, (None, None)
        for ids, (keys, values) in self.prefixes.items():
            n = 0
            limit = min(len(ids), len(prompt) - 1)
            while n < limit and ids[n] == prompt[n]:
                n += 1
            if n > best:
                best, found = n, ([k[:, :, :n] for k in keys], [v[:, :, :n] for v in values])
        return best, found

    def _remember(self, prompt: tuple[int, ...], cache: PrefixKV) -> None:
        layers = sorted(cache.keys)
        p = len(prompt)
        self.prefixes[prompt] = ([cache.keys[i][:, :, :p] for i in layers], [cache.values[i][:, :, :p] for i in layers])
        self.prefixes.move_to_end(prompt)
        while len(self.prefixes) > PREFIXES_KEPT:
            self.prefixes.popitem(last=False)


def frozen_dtype(name: str, weight: Tensor) -> torch.dtype:
    """"auto": bfloat16 on a CPU whose oneDNN has native bf16 (AVX512-BF16 / AMX), else the model's own."""
    if name == "bfloat16" or (name == "auto" and weight.device.type == "cpu" and weight.dtype == torch.float32
                              and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())):
        return torch.bfloat16
    return weight.dtype if name == "auto" else torch.float32
