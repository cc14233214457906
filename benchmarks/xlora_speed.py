"""X-LoRA decode speed against the base model and plain LoRA, and the classifier's time per token.

    .venv/bin/python benchmarks/xlora_speed.py [--rounds 5] [--new-tokens 128] [--threads 2]

The model is the built-in tiny-shakespeare with its shipped adapters
(py_engine/data/adapters/tiny-shakespeare: three LoRA experts of rank 8 on all seven
projections, an X-LoRA classifier of depth 2), each variant loaded as `LLM` loads it (the
CPU transforms applied) and decoded greedily by TorchBackend from a 16-token prompt, no
early stop:

- base: no adapter;
- lora: one expert (the comedies adapter), unmerged;
- xlora: X-LoRA, two passes per token (scaling pass + real pass, each with its KV cache);
- xlora-ng: X-LoRA non-granular (mistral.rs's tgt_non_granular_index = 1): scalings from
  the prompt's pass, then one pass per token; the CPU decode step runs the frozen mix merged
  into copies of the weights, made in the prompt's call (its cost is in "prompt call ms").

Both passes of granular X-LoRA and the single LoRA run in the one-call C decode step.

Variants alternate within each round (the order rotating); the table gives the median
decode tok/s, with min and max, each variant's median ratio to base over the rounds, and the
median ms of the prompt's call (16 tokens; X-LoRA: both passes). `classifier` is the X-LoRA
classifier's own forward on one token's hidden state (median of 2,000 calls); the scaling
pass's cost is the rest of the gap between xlora and lora.
Writes benchmarks/results/xlora_speed.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from common import HERE  # noqa: E402  (also puts the clone's root on sys.path)

from common import machine  # noqa: E402
from py_engine.backends.torch import TorchBackend  # noqa: E402

ADAPTERS = HERE.parent / "py_engine" / "data" / "adapters" / "tiny-shakespeare"
RESULTS = HERE / "results" / "xlora_speed.json"
VARIANTS = ("base", "lora", "xlora", "xlora-ng")


def build(variant: str):
    from py_engine.adapters import LoraManager
    from py_engine.adapters.xlora import load_xlora
    from py_engine.backends.torch import LLM

    llm = LLM("tiny-shakespeare", dtype="float32")
    model, lora = llm.model, None
    if variant == "lora":
        LoraManager(model).add("comedies", ADAPTERS / "comedies")
        lora = "comedies"
    elif variant.startswith("xlora"):
        model = load_xlora(model, ADAPTERS / "xlora", non_granular=1 if variant == "xlora-ng" else None)
    return model, llm.config, lora


def decode_tok_s(model, config, lora, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(decode tok/s after the prompt, ms of the prompt's call)."""
    backend = TorchBackend(model, config, config.max_position_embeddings, lora)
    start = time.perf_counter()
    token = backend.argmax(backend.prefill(prompt))
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        token = backend.argmax(backend.decode(token))
    return (new_tokens - 1) / (time.perf_counter() - start), prefill * 1e3


def classifier_ms(xlora_model) -> float:
    """Median ms of one classifier forward on one token, single-threaded as torch runs inside a decode
    step on the CPU kernels' path (kernel_step); with 2 OpenMP threads on a loaded machine a 3-matmul
    forward can wait ~20 ms for a descheduled thread."""
    hidden = torch.randn(1, 1, xlora_model.config.hidden_size)
    times = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.inference_mode():
        for _ in range(2000):
            start = time.perf_counter()
            xlora_model.classifier(hidden)
            times.append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **machine()}
    models = {v: build(v) for v in VARIANTS}
    prompt = list(range(5, 21))  # 16 tokens
    runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    prefill: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for v in order:
            tok_s, ms = decode_tok_s(*models[v], prompt, args.new_tokens)
            runs[v].append(tok_s)
            prefill[v].append(ms)
        print(f"round {r + 1}: " + "  ".join(f"{v} {runs[v][-1]:.0f}" for v in VARIANTS), flush=True)
    rows = {}
    for v in VARIANTS:
        ratios = [x / b for x, b in zip(runs[v], runs["base"])]
        rows[v] = {"median_tok_s": statistics.median(runs[v]), "min": min(runs[v]), "max": max(runs[v]),
                   "ratio_to_base": statistics.median(ratios), "runs": runs[v],
                   "prompt_ms": statistics.median(prefill[v])}
    clf = classifier_ms(models["xlora"][0])
    print("| variant | decode tok/s (median, min-max) | vs base | prompt call ms |\n|---|---|---|---|")
    for v, row in rows.items():
        print(f"| {v} | {row['median_tok_s']:.0f} ({row['min']:.0f}-{row['max']:.0f}) | {row['ratio_to_base']:.2f}x "
              f"| {row['prompt_ms']:.1f} |")
    print(f"classifier: {clf:.3f} ms per token")
    report = {**meta,
              "loadavg_end": os.getloadavg(), "new_tokens": args.new_tokens, "threads": args.threads,
              "rows": rows, "classifier_ms_per_token": clf}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
