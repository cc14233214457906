"""A GGUF K-quant mix in the web legs (issue 31): a small llama of 256-aligned rows written as llama.cpp's Q4_K_M
rule lays a file out (Q4_K everywhere, Q6_K for the head and attn_v/ffn_down in the layers use_more_bits picks, a
Q4_K token embedding) with one Q5_0 and one Q8_0 projection as llama-quantize's fallbacks put beside them, exported
for the web with int4 (what `ruvllm export --target web` writes for it: Q4_K keeps its own codes, scales and
minimums; Q5_0 becomes 8-bit codes; Q6_K is re-quantized to 8 bits with its error logged).

The npm package in Node and the page in Chromium must give onnxruntime-in-CPython's greedy tokens for it, on the
package's own wasm kernels (the export's contract has an `engine` entry), up to a near-tie
(smollm2_golden.check_greedy: both sides round activations to int8, in another order).
"""
from __future__ import annotations

from pathlib import Path

from tests.web.smollm2_golden import SmolLM2Web, _margins

PROMPT = "To be, or not"
MAX_TOKENS = 24
PRECISION = "int4"


def build_kquant_web(root: Path) -> SmolLM2Web:
    """The K-quant GGUF's int4 web export and CPython's greedy completion of PROMPT (one "chat" of it)."""
    from py_engine import LLM, SamplingParams
    from py_engine.hub import resolve_model
    from tests.importers.gguf_builder import byte_level_vocab, hf_model, write_gguf
    from tests.importers.test_gguf_kquants import k_mix
    from tests.tiny_models import train_tokenizer
    from web.build import export_for_web

    train_tokenizer(root)
    vocab = byte_level_vocab(root / "tokenizer.json", "gpt-2")
    rule = k_mix("Q4_K", 3)

    def kind(name, data):
        fallback = {"blk.1.attn_q.weight": "Q5_0", "blk.1.attn_output.weight": "Q8_0"}
        return fallback.get(name) or rule(name, data)
    model = hf_model("llama", len(vocab.tokens), hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                     initializer_range=0.05, max_position_embeddings=256)
    gguf = write_gguf(root / "q4_k_m.gguf", model, vocab, kind)
    export = export_for_web(resolve_model(str(gguf), str(root / "cache")), root / "q4_k_m-web", (PRECISION,))
    llm = LLM(str(export), backend="onnx", dtype=PRECISION)
    tokens = llm.generate(PROMPT, SamplingParams.greedy(max_tokens=MAX_TOKENS, ignore_eos=True)).token_ids
    margins, runner_up = _margins(export, llm.encode(PROMPT), tokens)
    return SmolLM2Web(export, [tokens], [margins], [runner_up])
