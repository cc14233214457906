"""Capacity of the two-tier KV cache: how many 4k-token sequences one KV budget holds at once.

    .venv/bin/python benchmarks/kv_capacity.py                       # SmolLM2-135M and the built-in model, 4 GiB
    .venv/bin/python benchmarks/kv_capacity.py --budget 1G --length 2048

Counted with the server's own parts, not a formula: the engine's sizing (kv_cache.split_budget,
kv_bytes_per_block, cold_bytes_per_block: what `ruvllm serve --kv-cache-memory` allocates) and its
BlockManager, driven as the scheduler drives it. N sequences are prefilled one after another in
chunks of --chunk tokens (each allocate demotes what the chunk's first query reads cold) until each
holds --length tokens and has the slot of its next token; N is the largest count for which all fit,
the hot pool sized for N running sequences of --length tokens (--max-concurrent N --max-context
LENGTH, as a user would set them); found by doubling and bisection. The
full-precision rows are budget // (blocks one sequence needs). Nothing is allocated: the numbers
are bytes. Writes benchmarks/results/kv_capacity.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from common import HERE  # noqa: E402  (also puts the clone's root on sys.path)

from native_server.engine.block_manager import BlockManager  # noqa: E402
from native_server.engine.kv_cache import cold_bytes_per_block, kv_bytes_per_block, split_budget  # noqa: E402
from native_server.serve import parse_size  # noqa: E402
from py_engine.config import ModelConfig  # noqa: E402
from py_engine.hub import resolve_model  # noqa: E402
from py_engine.models.kv_quant import KVQuantConfig  # noqa: E402

MODELS = {"SmolLM2-135M": "smollm2-135m-instruct", "built-in": "tiny-shakespeare"}
BUDGET_SHARE = {"SmolLM2-135M": 1, "built-in": 1 / 16}  # the built-in's KV is ~15x smaller a token
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fits(config: ModelConfig, quant: KVQuantConfig, dtype: torch.dtype, budget: int, n: int, length: int,
         chunk: int) -> bool:
    hot, cold = split_budget(config, quant, dtype, budget, n, chunk, length)
    if hot < 1:
        return False
    bm = BlockManager(hot, quant.block_size, True, cold, quant.hot_tokens)
    for seq in range(n):
        for start in range(0, length - 1, chunk):
            if bm.allocate(seq, start, min(chunk, length - 1 - start)) is None:
                return False
        if bm.allocate(seq, length - 1, 1) is None:  # the next token's step: its slot, and what turns cold
            return False
        bm.take_demotions()
    return True


def two_tier_capacity(config: ModelConfig, quant: KVQuantConfig, dtype: torch.dtype, budget: int, length: int,
                      chunk: int) -> int:
    """The largest N that fits: doubling, then bisection (more sequences only shrink the cold pool)."""
    def ok(n: int) -> bool:
        return fits(config, quant, dtype, budget, n, length, chunk)

    if not ok(1):
        return 0
    low, high = 1, 2
    while ok(high):
        low, high = high, 2 * high
    while high - low > 1:  # ok(low), not ok(high)
        mid = (low + high) // 2
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low


def rows_for(name: str, config: ModelConfig, budget: int, length: int, chunk: int, block_size: int) -> list[dict]:
    length = min(length, config.max_position_embeddings)
    rows = []
    for dtype_name, dtype in DTYPES.items():
        per_block = kv_bytes_per_block(config, block_size, dtype)
        n = budget // per_block // -(-length // block_size)
        rows.append({"model": name, "kv": f"auto ({dtype_name})", "hot_dtype": dtype_name, "length": length,
                     "bytes_per_token": per_block / block_size, "sequences": n})
    for dtype_name, dtype in DTYPES.items():
        for kv in ("int8", "int4"):
            quant = KVQuantConfig(kv, 128, block_size)
            n = two_tier_capacity(config, quant, dtype, budget, length, chunk)
            rows.append({"model": name, "kv": f"{kv}, 128 hot ({dtype_name})", "hot_dtype": dtype_name,
                         "length": length, "bytes_per_token": cold_bytes_per_block(config, quant) / block_size,
                         "sequences": n})
    fp32, bf16 = rows[0]["sequences"], rows[1]["sequences"]
    for r in rows:
        r["vs_fp32"] = r["sequences"] / fp32 if fp32 else None
        r["vs_bf16"] = r["sequences"] / bf16 if bf16 else None
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=parse_size, default=parse_size("4G"), help="KV cache bytes (default 4G; the built-in model gets 1/16)")
    parser.add_argument("--length", type=int, default=4096, help="tokens per sequence (default 4096; at most the "
                                                                  "model's context)")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk, --max-num-batched-tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--output", default=str(HERE / "results" / "kv_capacity.json"))
    args = parser.parse_args()
    rows: list[dict] = []
    for name, alias in MODELS.items():
        budget = int(args.budget * BUDGET_SHARE[name])
        rows += [r | {"budget_mib": budget / 2**20} for r in rows_for(
            name, ModelConfig.from_file(resolve_model(alias)), budget, args.length, args.chunk, args.block_size)]
    print(f"block size {args.block_size}, prefill chunk {args.chunk}\n")
    print("| model | KV budget | KV cache | tokens per sequence | bytes/token (cold) | sequences | vs fp32 | vs bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['budget_mib']:.0f} MiB | {r['kv']} | {r['length']} | {r['bytes_per_token']:.0f} | "
              f"{r['sequences']} | "
              f"x{r['vs_fp32']:.2f} | x{r['vs_bf16']:.2f} |")
    Path(args.output).write_text(json.dumps({"budget": args.budget, "block_size": args.block_size,
                                             "chunk": args.chunk, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
