"""The instant update, tuned for latency: one pattern's MicroLoRA on the last layer, trained on its pair only.

    trainer = InstantTrainer(model, config)
    lora, stats = trainer.train(example)     # ~ one frozen forward + a few ms of steps

Where the time goes, and what is cut (SmolLM2-135M, a 42-token chat prompt):
- The frozen forward: the base up to the last layer does not train, so it runs
  once, without gradients, over the prompt and the answer; the keys and values
  of the longest prefix it shares with a recent example (the chat template's
  system prompt) are reused (`PrefixKV`), so only the new tokens are computed.
- The steps: the MicroLoRA sits on the last layer's o_proj / down_proj (and
  gate / up), whose inputs at the answer's positions the frozen pass kept, so a
  step is those few rows through the last layer's output half and the head, not
  the sequence through the model.
- The head: the loss is a softmax over the answer's tokens and the base's
  `CANDIDATES` likeliest tokens at each position (its real competitors), not
  the 49152-word vocabulary; the full head checks the result once at the end.
- Steps stop once every answer token is the argmax with probability >= 1/2
  (`micro_steps` is the most): one correction, one update.
Other target modules, or more than one layer, take the general path
(`train_lora` over the whole model).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import SonaConfig
from .lora import TrainableLora
from .objective import Example
from .train import TrainStats, train_lora

CANDIDATES = 256  # base-likeliest tokens per position the fast loss normalises over, beside the answer's
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


class InstantTrainer:
    def __init__(self, model: nn.Module, config: SonaConfig) -> None:
        self.model, self.config = model, config
        self.prefixes: OrderedDict[tuple[int, ...], tuple[list[Tensor], list[Tensor]]] = OrderedDict()
        last = model.model.layers[-1]
        self.fast = (config.micro_layers == 1 and set(config.target_modules) <= FAST_MODULES
                     and not getattr(last, "sandwich", False) and not getattr(last, "moe", False)
                     and hasattr(last.self_attn, "o_proj") and model.config.final_logit_softcapping is None)

    def new_lora(self) -> TrainableLora:
        c = self.config
        return TrainableLora.for_model(self.model, c.target_modules, c.micro_layers, c.micro_rank, c.micro_alpha,
                                       seed=c.seed)

    def train(self, example: Example) -> tuple[TrainableLora, TrainStats]:
        """A fresh MicroLoRA trained on this one example (adapters already hooked into the model, such as
        the consolidated one, stay applied under it)."""
        lora = self.new_lora()
        if not self.fast:
            return lora, train_lora(self.model, lora, [example], steps=self.config.micro_steps,
                                    lr=self.config.micro_lr)
        start = time.perf_counter()
        captured = self.frozen_pass(example)
        stats = self.fit(lora, captured, torch.tensor(example.target_ids))
        return lora, TrainStats(stats[0], stats[1], stats[2], time.perf_counter() - start)

    @torch.no_grad()
    def frozen_pass(self, example: Example) -> Captured:
        model = self.model
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
        logits = model.lm_head(hidden[0, local]).float()  # [N, V]
        return Captured(got["x"][0, local].clone(), got["attn"][0, local].clone(), logits)

    def fit(self, lora: TrainableLora, captured: Captured, targets: Tensor) -> tuple[int, float, float]:
        """Adam steps on the cut loss until each answer token wins; (steps, first loss, last loss).

        The cut softmax cannot see a token outside its candidates rising: whenever it says done, the full
        head checks, and the tokens that beat the answer there join the candidates (then training goes on)."""
        model, last = self.model, self.model.model.layers[-1]
        k = min(CANDIDATES, captured.logits.shape[-1])
        candidates = captured.logits.topk(k, -1).indices  # [N, k]
        optimizer = torch.optim.Adam(lora.parameters(), lr=self.config.micro_lr)
        first = last_loss = float("nan")
        steps = 0
        head, labels = self._cut_head(targets, candidates)
        with lora.attached(model), torch.enable_grad():
            for steps in range(1, max(1, self.config.micro_steps) + 1):
                h = captured.x + last.self_attn.o_proj(captured.attn)  # [N, hidden]
                h = h + last.mlp(last.post_attention_layernorm(h))
                z = model.model.norm(h)
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
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        return steps, first, last_loss

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
        logp = self.model.lm_head(z).float().log_softmax(-1)  # [N, V]
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
