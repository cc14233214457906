"""Sampled speculative decoding draws from the target's own distribution (Leviathan et al.'s guarantee).

A tiny random model (vocabulary ~300, tests/tiny_models.py) is the target. Its first generated token is forced
(the prefill row allows one token only), so the second token is the first one a verify pass decides: 20,000
seeded generations of 3 tokens through py_engine.generate's real loop give the empirical next-token distribution
(t2) and two-token distribution (t2, t3), held by a chi-square test against the exact ones computed from the
model's rows with the reference sampler's probabilities (temperature, top-p). Drafts come from (a) a fixed
one-hot proposal (prompt lookup's case: the second most likely t2, then the likeliest t3 after it) and (b) a
second tiny model sampling its own q (the min(1, p/q) test and the residual draw). The model's rows are
memoized per context (a row depends on its context only: the kernels' one numeric path), so a draw costs the
loop and the sampling, not a forward pass. A negative control (every draft kept) must fail the same test.
"""
from __future__ import annotations

import math
import os
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from py_engine.generate import complete  # noqa: E402
from py_engine.models import load_model  # noqa: E402
from py_engine.sampling import SamplingParams, token_probabilities  # noqa: E402
from py_engine.speculative import SpeculativeConfig, Speculation  # noqa: E402
from py_engine.tokenizer import Tokenizer  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

DRAWS = 20_000
PROMPT = [40, 41, 42, 43]
FORCED = 50  # the first generated token


class MemoBackend:
    """A model's rows as lists, memoized per context; the single-sequence Backend protocol."""

    max_context = 64

    def __init__(self, model, forced_first: int | None = None) -> None:
        self.model, self.forced, self.rows, self.tokens = model, forced_first, {}, []

    def row(self, context: tuple[int, ...]) -> list[float]:
        if context not in self.rows:
            with torch.inference_mode():
                ids = torch.tensor([list(context)])
                self.rows[context] = self.model(ids, torch.arange(len(context))[None], None)[0, -1].tolist()
        return self.rows[context]

    def prefill(self, ids):
        self.tokens = list(ids)
        if self.forced is None:
            return self.row(tuple(self.tokens))
        row = [-math.inf] * len(self.row(tuple(self.tokens)))
        row[self.forced] = 0.0
        return row

    def decode(self, token):
        return self.verify([token])[0]

    def verify(self, tokens):
        rows = []
        for t in tokens:
            self.tokens.append(t)
            rows.append(self.row(tuple(self.tokens)))
        return rows

    def rollback(self, n):
        del self.tokens[len(self.tokens) - n:]


class FixedDrafts:
    """A proposer whose drafts are one-hot and fixed (prompt lookup's case), with the session interface."""

    def __init__(self, drafts, keep_all=False):
        self.drafts, self.keep_all, self.qs, self.rng = drafts, keep_all, None, None

    def start(self, prompt, params):
        return self

    def propose(self, room):
        return self.drafts[:room]

    def keep(self, tokens):
        pass

    def record(self, drafted, accepted):
        pass

    def timed(self, drafted, seconds):
        pass

    def finish(self):
        pass


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof / 2, x / 2)."""
    a, z = dof / 2, x / 2
    if z <= 0:
        return 1.0
    log_front = a * math.log(z) - z - math.lgamma(a)
    if z < a + 1:  # series for P, then 1 - P
        term = total = 1 / a
        for n in range(1, 10_000):
            term *= z / (a + n)
            total += term
            if term < total * 1e-15:
                break
        return max(0.0, 1 - math.exp(log_front) * total)
    b, c, d = z + 1 - a, 1e300, 1 / (z + 1 - a)  # continued fraction for Q (Lentz)
    h = d
    for n in range(1, 10_000):
        an = -n * (n - a)
        b += 2
        d = an * d + b
        d = 1 / (d if abs(d) > 1e-300 else 1e-300)
        c = b + an / c
        c = c if abs(c) > 1e-300 else 1e-300
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def chi2_pvalue(counts: Counter, expected: dict, draws: int) -> float:
    """Cells with an expected count >= 5, the rest pooled into one."""
    big = [k for k, p in expected.items() if p * draws >= 5]
    stat = sum((counts.get(k, 0) - expected[k] * draws) ** 2 / (expected[k] * draws) for k in big)
    rest_expected = (1 - sum(expected[k] for k in big)) * draws
    rest_seen = draws - sum(counts.get(k, 0) for k in big)
    cells = len(big)
    if rest_expected >= 5:
        stat += (rest_seen - rest_expected) ** 2 / rest_expected
        cells += 1
    return chi2_sf(stat, cells - 1)


# The full grid with RUVLLM_SPEC_GRID=1 (~3 min of CPU); by default the two diagonal cases (both temperatures, both
# proposers) keep the suite's time down.
GRID = [(0.7, 0.9, "one-hot"), (1.0, 0.95, "draft model")] + (
    [(0.7, 0.9, "draft model"), (1.0, 0.95, "one-hot")] if os.environ.get("RUVLLM_SPEC_GRID") else [])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)  # small forwards: one thread (a second waits on a busy machine)
    target = build_tiny_model(tmp_path_factory.mktemp("target"), seed=0, initializer_range=0.05)
    draft = build_tiny_model(tmp_path_factory.mktemp("draft"), seed=1, initializer_range=0.05)
    load = lambda folder: load_model(folder, dtype="float32")[0].eval()  # noqa: E731
    return load(target), load(draft), Tokenizer.from_pretrained(target)


def exact(target: MemoBackend, params: SamplingParams):
    """The exact next-token and two-token distributions after the prompt and the forced token."""
    context = (*PROMPT, FORCED)
    p2 = token_probabilities(target.row(context), params)
    pairs = {}
    for t2, a in p2.items():
        for t3, b in token_probabilities(target.row((*context, t2)), params).items():
            pairs[(t2, t3)] = a * b
    return p2, pairs


def draw(models, params: SamplingParams, speculation, draws: int = DRAWS):
    target_model, _, tokenizer = models
    backend = MemoBackend(target_model, FORCED)
    singles, pairs = Counter(), Counter()
    for seed in range(draws):
        p = SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=seed, max_tokens=3,
                           ignore_eos=True)
        out = complete(backend, tokenizer, PROMPT, p, (), speculation).token_ids
        assert out[0] == FORCED
        singles[out[1]] += 1
        pairs[tuple(out[1:3])] += 1
    return backend, singles, pairs


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_p, proposer", GRID)
def test_sampled_output_has_the_target_distribution(models, temperature, top_p, proposer):
    params = SamplingParams(temperature=temperature, top_p=top_p)
    target = MemoBackend(models[0])
    p2, p23 = exact(target, params)
    if proposer == "one-hot":
        ranked = sorted(p2, key=p2.get, reverse=True)
        second = ranked[1]
        after = token_probabilities(target.row((*PROMPT, FORCED, second)), params)
        speculation = FixedDrafts([second, max(after, key=after.get)])
    else:
        config = SpeculativeConfig(method="draft_model", model="tiny-draft", num_speculative_tokens=2,
                                   acceptance_floor=0)  # every step drafts: the rule is what is tested
        speculation = Speculation(config, draft_backend=lambda: MemoBackend(models[1]))
    _, singles, pairs = draw(models, params, speculation)
    assert chi2_pvalue(singles, p2, DRAWS) > 1e-3
    assert chi2_pvalue(pairs, p23, DRAWS) > 1e-3
    if proposer == "draft model":
        assert speculation.stats.num_accepted_tokens > DRAWS // 10  # the min(1, p/q) test kept some drafts


def test_the_test_can_fail(models, monkeypatch):
    """Keeping every one-hot draft skews the next-token distribution: the same chi-square rejects it."""
    import py_engine.generate as generate

    params = SamplingParams(temperature=1.0, top_p=0.95)
    target = MemoBackend(models[0])
    p2, _ = exact(target, params)
    second = sorted(p2, key=p2.get, reverse=True)[1]
    original = generate._Picker.__call__

    def keep_all(self, logits, output, mask, draft, spec, position):
        sample, kept = original(self, logits, output, mask, draft, spec, position)
        if draft is not None:
            return type(sample)(draft), True
        return sample, kept
    monkeypatch.setattr(generate._Picker, "__call__", keep_all)
    _, singles, _ = draw(models, params, FixedDrafts([second]), draws=2000)
    assert chi2_pvalue(singles, p2, 2000) < 1e-6
