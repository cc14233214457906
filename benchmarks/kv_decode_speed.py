"""Decode speed with the two-tier KV cache: tokens/s of one sequence at a 4k-token context, `LLM`'s path.

    .venv/bin/python benchmarks/kv_decode_speed.py                 # SmolLM2-135M-Instruct, 4096 tokens
    .venv/bin/python benchmarks/kv_decode_speed.py --model tiny-shakespeare --context 200

The prompt (the built-in model's validation text) is prefilled once with the full-precision cache;
each setting then gets a copy of that cache (a two-tier one settled at the context: every block past
the hot window quantized, as it would be after decoding that far) and decodes --tokens greedy tokens
through TorchBackend.decode, the CPU kernels' one-call step where it applies. Settings alternate
within each of --rounds rounds (A/B/C, so a busy machine's swings hit every setting alike); the table
gives the median tok/s and its ratio to full precision. Writes benchmarks/results/kv_decode_speed.json
with the CPU flags.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from common import HERE  # noqa: E402  (also puts the clone's root on sys.path)

from common import machine  # noqa: E402
from py_engine.backends.torch import LLM, TorchBackend  # noqa: E402
from py_engine.models import DenseKVCache  # noqa: E402
from py_engine.models.kv_quant import KVQuantConfig  # noqa: E402

SETTINGS = [("auto", 128), ("int8", 128), ("int4", 128)]
TEXT = HERE.parent / "py_engine" / "data" / "tiny-shakespeare" / "validation.txt"


def backend_from(llm: LLM, prefilled: TorchBackend, quant: KVQuantConfig) -> TorchBackend:
    """A backend whose cache is a copy of `prefilled`'s, two-tier and settled when quant asks."""
    backend = TorchBackend(llm.model, llm.config, llm.max_context, kv_quant=quant)
    src = prefilled.kv
    kv = DenseKVCache.allocate(llm.config, 1, src.max_len, src.keys[0].dtype, src.keys[0].device, quant=quant)
    for a, b in zip(src.keys + src.values, kv.keys + kv.values):
        b.copy_(a)
    if quant.enabled:
        kv.settle(prefilled.length)
    backend.kv, backend.length, backend.tokens = kv, prefilled.length, list(prefilled.tokens)
    return backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed per setting and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output", default=str(HERE / "results" / "kv_decode_speed.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype)
    ids = llm.encode(TEXT.read_text(encoding="utf-8")[:60_000])[:args.context - args.tokens - 1]
    prefilled = TorchBackend(llm.model, llm.config, llm.max_context)
    start = time.perf_counter()
    first = int(torch.argmax(prefilled.prefill(ids)))
    print(f"prefilled {len(ids)} tokens in {time.perf_counter() - start:.1f} s", flush=True)
    times: dict[str, list[float]] = {f"{d}/{h}": [] for d, h in SETTINGS}
    for rnd in range(args.rounds):
        order = SETTINGS[rnd % len(SETTINGS):] + SETTINGS[:rnd % len(SETTINGS)]
        for dtype, hot in order:
            backend = backend_from(llm, prefilled, KVQuantConfig(dtype, hot))
            token = first
            backend.decode(token)  # the first step lays out the one-call plan for this cache
            start = time.perf_counter()
            for _ in range(args.tokens):
                token = backend.argmax(backend.decode(token))
            times[f"{dtype}/{hot}"].append(args.tokens / (time.perf_counter() - start))
    base = statistics.median(times["auto/128"])
    rows = [{"kv": key.split("/")[0], "hot_tokens": int(key.split("/")[1]), "context": len(ids) + 1,
             "tok_s": statistics.median(v), "runs": v, "vs_full": statistics.median(v) / base}
            for key, v in times.items()]
    print(f"\n{args.model}, {len(ids) + 1}-token context, {args.tokens} decode steps x {args.rounds} rounds, "
          f"{args.threads} threads\n")
    print("| KV cache | hot tokens | decode tok/s (median) | vs full precision |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['kv']} | {r['hot_tokens'] if r['kv'] != 'auto' else '-'} | {r['tok_s']:.2f} | "
              f"x{r['vs_full']:.2f} |")
    weight = next(llm.model.parameters())
    Path(args.output).write_text(json.dumps({"machine": machine(), "model": args.model, "dtype": str(weight.dtype),
                                             "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
