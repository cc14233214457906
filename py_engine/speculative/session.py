"""One sequence's drafting: prompt lookup or a draft model, as many drafts a step as pay, counted.

    speculation = Speculation(config)                              # ngram
    speculation = Speculation(config, draft_backend=make_backend)  # a draft model: a Backend factory
    seq = speculation.start(prompt_ids, params)                     # per request
    drafts = seq.propose(room)       # tokens to verify after the pending one (maybe [])
    seq.keep(tokens)                 # the tokens the sequence kept (target's and accepted drafts)
    seq.record(len(drafts), accepted)
    seq.timed(len(drafts), seconds)  # the step's time (proposing + forward): how many drafts pay (DraftLength)

A draft model runs as any single-sequence Backend (py_engine.generate's: prefill, decode, verify, rollback) over
its own KV cache, kept in step with the tokens the target kept: before proposing, the draft rolls back to the
longest prefix it shares with them and feeds the rest in one call. It drafts greedily for greedy requests (q
one-hot) and for sampled ones draws from its own processed distribution q (the request's temperature, top-k/p,
penalties), whose probabilities `qs` the verifier needs (accept.py). Stdlib only (ring 0).
"""
from __future__ import annotations

import random
from typing import Any, Callable, Sequence

from py_engine.sampling import SamplingParams, sample_token, token_probabilities

from .config import SpeculativeConfig
from .ngram import NgramLookup
from .stats import DraftLength, SpecStats, StepCosts


class Speculation:
    """What an engine speculates with; `start` gives each sequence its own state."""

    def __init__(self, config: SpeculativeConfig, draft_backend: Callable[[], Any] | None = None) -> None:
        if config.method == "draft_model" and draft_backend is None:
            raise ValueError("a draft_model config needs the draft model's backend factory")
        self.config, self.draft_backend = config, draft_backend
        self.stats = SpecStats()  # every sequence's steps, merged as they finish
        self.costs = StepCosts(config.num_speculative_tokens)  # seconds a step with k drafts takes, all sequences

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> "SequenceSpeculation":
        return SequenceSpeculation(self, prompt_ids, params)


class SequenceSpeculation:
    def __init__(self, owner: Speculation, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        config = owner.config
        self.owner, self.params, self.k = owner, params, config.num_speculative_tokens
        self.context = list(prompt_ids)
        self.prompt_len = len(self.context)
        self.stats = SpecStats()
        self.length = DraftLength(config.acceptance_floor, self.k, owner.costs)
        self.qs: list[dict[int, float]] | None = None  # the draft's distributions of the last proposal (sampled)
        self._key: int | None = None  # the n-gram length the last proposal matched (DraftLength's estimate), or None
        if config.method == "ngram":
            self.lookup: NgramLookup | None = NgramLookup(self.context, config.prompt_lookup_max,
                                                          config.prompt_lookup_min)
            self.draft = None
        else:
            self.lookup = None
            self.draft = DraftSession(owner.draft_backend(), params)

    @property
    def rng(self) -> random.Random | None:
        """The draft's own random stream (acceptance tests of sampled drafts), or None."""
        return None if self.draft is None else self.draft.rng

    def propose(self, room: int) -> list[int]:
        """Up to min(k, room) tokens to verify after the last kept one; [] to decode plainly."""
        self.qs = None
        if self.lookup is not None:  # the lookup first: the length of the n-gram it matched says how far to trust it
            drafts = self.lookup.propose(min(self.k, room))
            self._key = self.lookup.matched
            return drafts[:self.length.choose(room, self._key)] if drafts else []
        k = self.length.choose(room)
        if k < 1:
            return []
        drafts, self.qs = self.draft.propose(self.context, k, self.context[self.prompt_len:])
        return drafts

    def keep(self, tokens: Sequence[int]) -> None:
        self.context.extend(tokens)
        if self.lookup is not None:
            self.lookup.extend(tokens)

    def record(self, drafted: int, accepted: int) -> None:
        self.stats.record(drafted, accepted)
        self.length.record(drafted, accepted, self._key)

    def timed(self, drafted: int, seconds: float) -> None:
        """A step with `drafted` drafts took `seconds` (proposing + the forward pass): the engine's costs."""
        self.owner.costs.record(drafted, seconds)

    def finish(self) -> SpecStats:
        """Merge this sequence's counts into the engine's; returns them."""
        self.owner.stats.add(self.stats)
        return self.stats


class DraftSession:
    """A draft model's backend following one sequence."""

    def __init__(self, backend: Any, params: SamplingParams) -> None:
        self.backend, self.params = backend, params
        self.greedy = params.is_greedy
        self.rng = random.Random(f"draft:{params.seed}") if params.seed is not None else random.Random()
        self.fed: list[int] = []  # the tokens in the draft's KV cache, in order
        self.last: Any = None  # the draft's logits after `fed`

    def _sync(self, context: Sequence[int]) -> Any:
        """Bring the draft's cache to `context`; its logits after the last token."""
        n = 0
        limit = min(len(self.fed), len(context))
        while n < limit and self.fed[n] == context[n]:
            n += 1
        if n == 0:
            self.fed, self.last = list(context), self.backend.prefill(context)
            return self.last
        if n < len(self.fed):
            self.backend.rollback(len(self.fed) - n)
            del self.fed[n:]
            self.last = None
        if n < len(context):
            rows = self.backend.verify(context[n:])
            self.fed.extend(context[n:])
            self.last = rows[-1]
        if self.last is None:  # the context ends inside what was fed: feed its last token again
            self.backend.rollback(1)
            self.last = self.backend.verify([self.fed[-1]])[-1]
        return self.last

    def propose(self, context: Sequence[int], k: int, output: Sequence[int]
                ) -> tuple[list[int], list[dict[int, float]] | None]:
        logits = self._sync(context)
        room = self.backend.max_context - len(context)
        drafts: list[int] = []
        qs: list[dict[int, float]] | None = None if self.greedy else []
        prompt = context[:len(context) - len(output)]
        for i in range(min(k, room - 1)):
            history = [*output, *drafts]
            if self.greedy:
                token = sample_token(logits, self.params, 0.0, history, prompt)
            else:
                q = token_probabilities(logits, self.params, history, prompt)
                token = _draw(q, self.rng.random())
                qs.append(q)
            drafts.append(token)
            if i + 1 < k:
                logits = self.backend.verify([token])[-1]
                self.fed.append(token)
                self.last = logits
        return drafts, qs


def _draw(q: dict[int, float], u: float) -> int:
    """A token of q by inverse CDF over ascending ids."""
    target, running, last = u * sum(q.values()), 0.0, None
    for token, w in sorted(q.items()):
        running += w
        last = token
        if running > target:
            return token
    return last
