"""Our native Q4_1 path against llama.cpp itself on SmolLM2-135M-Instruct's GGUF (a golden file).

tests/importers/data/smollm2_q4_1_llama_cpp.json holds llama.cpp's output (llama-cpp-python 0.3.36, built from
its vendored llama.cpp; the exact command is in the file): for 5 chat prompts its prompt token ids and 32
greedy tokens with the margin between its two largest logits at each step, and its ids for texts that
exercise the `smollm` pre-tokenizer. CI does not build llama.cpp: rerun scripts/llama_cpp_golden.py to
refresh the file. Our side is what `LLM("smollm2-135m-instruct")` runs: the Q4_1 codes in quant.c (in
decode with x as it is, or rounded to int8 per 32 values as llama.cpp's Q8_1 scheme does), the one-call step.

Greedy tokens must be identical on at least 4 of the 5 prompts with fp32 x against the codes (3 with x
rounded to int8, the default decode path); where they part, the step must be a near-tie in llama.cpp's own
logits or ours (the two round x and sum in different orders; llama.cpp's KV cache is fp16), which the test
prints.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.importers.smollm2_file import smollm2_path

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from py_engine.chat import load_chat_config, render_chat  # noqa: E402
from py_engine.hub import resolve_model  # noqa: E402
from py_engine.models import DenseKVCache, load_model  # noqa: E402
from py_engine.cpu.transforms import optimize_for_cpu  # noqa: E402
from py_engine.tokenizer import Tokenizer  # noqa: E402

GOLDEN = json.loads((Path(__file__).parent / "data" / "smollm2_q4_1_llama_cpp.json").read_text(encoding="utf-8"))
NEAR_TIE = 0.5  # logits: a divergence needs the two leading logits this close in one of the engines


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = smollm2_path()
    assert path.stat().st_size == GOLDEN["model_bytes"]
    folder = resolve_model(str(path), str(tmp_path_factory.mktemp("cache")))
    model, config = load_model(folder)
    optimize_for_cpu(model)
    return folder, model, config, Tokenizer.from_pretrained(folder)


@torch.inference_mode()
def greedy(model, config, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    kv = DenseKVCache.allocate(config, 1, len(ids) + steps, torch.float32, "cpu")
    logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], kv, last_only=True)[0, -1]
    tokens, margins = [], []
    for i in range(steps):
        top = torch.topk(logits, 2).values
        tokens.append(int(logits.argmax()))
        margins.append(float(top[0] - top[1]))
        logits = model(torch.tensor([[tokens[-1]]]), torch.tensor([[len(ids) + i]]), kv)[0, -1]
    return tokens, margins


def test_prompts_and_digit_texts_tokenize_as_llama_cpp(setup):
    folder, _, _, tokenizer = setup
    chat = load_chat_config(folder)
    for case in GOLDEN["cases"]:
        assert render_chat([{"role": "user", "content": case["question"]}], chat,
                           add_generation_prompt=True) == case["prompt"]
        assert tokenizer.encode(case["prompt"], add_special_tokens=False) == case["prompt_ids"]
    for item in GOLDEN["tokenize"]:
        assert tokenizer.encode(item["text"], add_special_tokens=False) == item["ids"], item["text"]


@pytest.mark.parametrize("int8_activations,at_least", [(False, 4), (True, 2)], ids=["exact-x", "int8-x"])
def test_native_q4_1_greedy_matches_llama_cpp(setup, int8_activations, at_least):
    """exact-x: fp32 x against the Q4_1 codes; int8-x (the default decode path): x rounded per 32 values,
    as llama.cpp does with its own rounding (fp16 block scales) and an fp16 KV cache: it parts from
    llama.cpp on more prompts, each time at a near-tie (asserted for every divergence). The count moved
    from 3 to 2 of 5 when prefills under 32 tokens joined the int8 path and Q4_1 rows took the AVX-512
    tiles' summation order (issue 16): the three divergences are at top-2 margins of 0.005-0.09."""
    from py_engine.quant.linear import set_int8_activations

    _, model, config, tokenizer = setup
    set_int8_activations(model, int8_activations)
    same, report = 0, []
    for case in GOLDEN["cases"]:
        ours, margins = greedy(model, config, case["prompt_ids"], GOLDEN["steps"])
        theirs = case["greedy_ids"]
        if ours == theirs:
            same += 1
            continue
        step = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        margin = min(case["top2_margins"][step], margins[step])
        report.append(f"{case['question']!r}: step {step}: ours {tokenizer.decode([ours[step]])!r}, llama.cpp "
                      f"{tokenizer.decode([theirs[step]])!r}; top-2 margin llama.cpp "
                      f"{case['top2_margins'][step]:.3f}, ours {margins[step]:.3f}")
        assert margin < NEAR_TIE, report[-1]
    print(f"\nidentical greedy tokens on {same} of {len(GOLDEN['cases'])} prompts", *report, sep="\n")
    assert same >= at_least, report
