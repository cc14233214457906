"""The batched torch sampler against the pure-Python reference sampler (py_engine.sampling).

Same u per row -> the same token; greedy identical; seeded streams identical
to the reference `Sampler`; logprobs equal; frequencies within bounds.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from native_server.engine import sampler
from native_server.engine.sampler import SamplingRow, sample
from py_engine.sampling import Sampler, SamplingParams, sample_token, token_probabilities

torch.set_num_threads(1)


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 1.0, 0.5, 1.7]),
        top_k=rng.choice([0, -1, 1, 3, 40, 100, vocab + 5]),
        top_p=rng.choice([1.0, 0.3, 0.9, 0.999]),
        min_p=rng.choice([0.0, 0.0, 0.02, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.7]),
        presence_penalty=rng.choice([0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.3]),
        logit_bias=rng.choice([{}, {0: 1.5, vocab - 1: -100.0, 7: 3.0}]),
    )


def random_logits(rng: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Mixed rows: smooth, peaked, and integer-valued ones with many exact ties."""
    x = torch.randn(rows, vocab, generator=rng) * torch.tensor([0.5, 3.0, 8.0])[torch.arange(rows) % 3, None]
    ties = torch.randint(-3, 3, (rows, vocab), generator=rng).float()
    return torch.where((torch.arange(rows) % 4 == 3)[:, None], ties, x)


@pytest.mark.parametrize("group", [None, 1, 5])  # rows sampled together: all 24 (the default budget here), 1, 5
@pytest.mark.parametrize("vocab", [50, 300, 5000])  # past each walk width: 64, then 2048, then a full sort
def test_same_u_gives_the_reference_token(vocab, group, monkeypatch):
    if group is not None:
        monkeypatch.setattr(sampler, "CHUNK_BYTES", 8 * vocab * group)
    rng, gen = random.Random(vocab), torch.Generator().manual_seed(vocab)
    for _ in range(12):
        logits = random_logits(gen, 24, vocab)
        rows = []
        for i in range(24):
            params = random_params(rng, vocab)
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
            output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
            rows.append(SamplingRow(params, None if params.is_greedy else rng.random(), prompt, output))
        got = [s.token_id for s in sample(logits, rows)]
        want = [sample_token(logits[i].tolist(), r.params, r.u or 0.0, r.output_token_ids, r.prompt_token_ids)
                for i, r in enumerate(rows)]
        assert got == want


def test_ties_come_out_in_ascending_id_order():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0] * 20])  # 120 ids, 60 of them tied at the top
    params = SamplingParams(top_k=0)
    for u in [i / 50 for i in range(50)]:
        rows = [SamplingRow(params, u, [], [])]
        assert sample(logits, rows)[0].token_id == sample_token(logits[0].tolist(), params, u)


def test_greedy_takes_the_lowest_index_of_the_max():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    rows = [SamplingRow(SamplingParams.greedy(), None, [], [])] * 2
    assert [s.token_id for s in sample(logits, rows)] == [1, 0]
    biased = SamplingRow(SamplingParams.greedy(logit_bias={3: 4.5}), None, [], [])
    assert sample(logits[:1], [biased])[0].token_id == 3


def test_greedy_batch_equals_the_reference_and_torch_argmax():
    """The all-greedy batch takes numpy's argmax on the CPU: the reference's token on smooth and tied rows,
    torch's argmax on rows with NaN and -inf (which the reference does not take)."""
    logits = random_logits(torch.Generator().manual_seed(3), 8, 20000)
    greedy = SamplingParams.greedy()
    tokens = [s.token_id for s in sample(logits, [SamplingRow(greedy, None, [], [])] * 8)]
    assert tokens == [sample_token(row.tolist(), greedy, None) for row in logits]
    odd = torch.tensor([[1.0, float("nan"), 2.0, float("nan")], [float("-inf")] * 4, [0.0, -1.0, 7.0, 7.0]])
    for x in (odd, odd.double()):
        assert [s.token_id for s in sample(x, [SamplingRow(greedy, None, [], [])] * 3)] == x.argmax(-1).tolist()


def test_seeded_streams_equal_the_reference_sampler():
    vocab, gen = 200, torch.Generator().manual_seed(3)
    params = [SamplingParams(seed=s, top_p=0.9, temperature=0.8, repetition_penalty=1.2) for s in range(6)]
    references = [Sampler(p) for p in params]
    streams = [random.Random(p.seed) for p in params]
    outputs: list[list[int]] = [[] for _ in params]
    for _ in range(20):
        logits = torch.randn(len(params), vocab, generator=gen) * 3
        rows = [SamplingRow(p, streams[i].random(), [1, 2], outputs[i]) for i, p in enumerate(params)]
        got = [s.token_id for s in sample(logits, rows)]
        want = [references[i].sample(logits[i].tolist(), outputs[i], [1, 2]) for i in range(len(params))]
        assert got == want
        for out, token in zip(outputs, got):
            out.append(token)


def test_logprobs_equal_the_reference():
    vocab, gen = 90, torch.Generator().manual_seed(5)
    logits = torch.randn(3, vocab, generator=gen) * 4
    logits[2, :10] = logits[2].max()  # ties at the top
    for k in (0, 1, 5, 12):
        params = SamplingParams(logprobs=k, seed=1)
        rows = [SamplingRow(params, 0.25, [], [])] * 3
        for i, got in enumerate(sample(logits, rows)):
            want = Sampler(params, random.Random()).sample_with_logprobs(logits[i].tolist())
            token_want = sample_token(logits[i].tolist(), params, 0.25)
            assert got.token_id == token_want and got.rank == _rank(logits[i], token_want)
            assert got.logprob == pytest.approx(_logprob(logits[i], token_want), abs=1e-12)
            assert [t.token_id for t in got.top_logprobs] == [t.token_id for t in want.top_logprobs]
            for a, b in zip(got.top_logprobs, want.top_logprobs):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-12)


def _logprob(row: torch.Tensor, token: int) -> float:
    x = row.tolist()
    top = max(x)
    return x[token] - top - math.log(math.fsum(math.exp(v - top) for v in x))


def _rank(row: torch.Tensor, token: int) -> int:
    return 1 + sum(v > row[token].item() for v in row.tolist())


def test_sampled_frequencies_match_the_reference_distribution():
    vocab, draws = 12, 4000
    logits = torch.tensor([[2.0, 1.5, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0, 0.2, 0.9]])
    params = SamplingParams(temperature=0.9, top_p=0.95, min_p=0.05, seed=0)
    rng = random.Random(7)
    rows = [SamplingRow(params, rng.random(), [], []) for _ in range(draws)]
    tokens = [s.token_id for s in sample(logits.expand(draws, vocab), rows)]
    probs = token_probabilities(logits[0].tolist(), params)
    for token in range(vocab):
        p = probs.get(token, 0.0)
        freq = tokens.count(token) / draws
        assert abs(freq - p) <= 5 * math.sqrt(p * (1 - p) / draws) + 1e-9, (token, freq, p)


def _builtin_masks():
    """Real token masks: a JSON schema's grammar states over the built-in 4k vocabulary."""
    from tests.paths import REPO
    from py_engine.guided import Guide, StructuredOutputsParams, token_grammar
    from py_engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(REPO / "py_engine" / "data" / "tiny-shakespeare")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}, "s": {"type": "string"}},
              "required": ["n", "s"]}
    grammar = token_grammar(StructuredOutputsParams(json=schema), tok, [0])
    masks = [grammar.mask(q) for q in range(grammar.dfa.num_states)]
    guide = Guide(grammar)
    for token in tok.encode('{"n": 7, "s": "To be"}'):
        guide.advance(token)
    return masks + [guide.mask(), grammar.eos_mask()], tok.vocab_size


def test_masked_rows_equal_the_reference_sampler():
    """Step 0: a row's grammar mask (MaskTensors of real TokenMasks) gives the reference's token,
    for few- and many-token masks, EOS-only ones, greedy and top-k past the allowed count."""
    from native_server.engine.sampler import MaskTensors

    masks, vocab = _builtin_masks()
    counts = sorted({m.count for m in masks})
    assert counts[0] == 1 and counts[-1] > vocab // 2  # single-token masks and wide ones
    tensors = MaskTensors(vocab + 3, torch.device("cpu"))  # the model's rows may be wider than the vocabulary
    rng, gen = random.Random(11), torch.Generator().manual_seed(11)
    for _ in range(6):
        logits = random_logits(gen, 24, vocab + 3)
        chosen = [rng.choice(masks) for _ in range(24)]
        rows = []
        for mask in chosen:
            params = random_params(rng, vocab)
            rows.append(SamplingRow(params, None if params.is_greedy else rng.random(), [1, 5],
                                    [rng.randrange(vocab) for _ in range(3)], tensors.get(mask)))
        got = [s.token_id for s in sample(logits, rows)]
        want = [sample_token(logits[i].tolist(), r.params, r.u or 0.0, r.output_token_ids, r.prompt_token_ids, m)
                for i, (r, m) in enumerate(zip(rows, chosen))]
        assert got == want
        assert all(m.bitmap()[t] for t, m in zip(got, chosen))
