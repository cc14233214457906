"""Prefill and decode speed of ruvllm's torch engine against transformers' generate, on CPU.

    python benchmarks/decode_speed.py [--dtypes float32,bfloat16] [--rounds 3]
        [--prompt-lengths 128,512] [--new-tokens 128] [--engines ruvllm,transformers] [--threads 2]

The model has Qwen2.5-0.5B's real shape (494M parameters, a tied 151936 x 896
embedding) with seeded random weights (see decode_engines.py). For each
prompt length it measures time to first token (prefill plus the first greedy
token; prefill tok/s is the prompt length over it) and decode tok/s over the
remaining new tokens, greedy, no early stop; and each engine's peak RSS (VmHWM), with
its anonymous / file-backed split sampled at its largest RSS.

The machine is shared and its memory bandwidth swings within minutes, so
every measurement is a fresh process (decode_engines.py), engines alternate
within a round (the order rotating between rounds), and the table gives the
median with min and max; ratios are per-round pairs, then their median.
`llama.cpp` (with --llama-cpp-python) runs the same weights as GGUF through
llama-cpp-python. Engine variants: `ruvllm:noopt` (no CPU transforms), `ruvllm:nokernels`
(fused projections only), `ruvllm:nolayers` (projections on the kernels,
norms and attention in torch), `ruvllm@REV` (py_engine at git revision REV), and
`:thp` on any engine, which runs it with THP_MEM_ALLOC_ENABLE=1 (torch's
allocator asks for huge pages), `:keeplib` with RUVLLM_KEEP_LIBRARY_PAGES=1 (the
shared-library pages `import torch` touched stay resident). Quantized: `ruvllm:int8`, `ruvllm:int4` (in-situ
RTN at load, its seconds in the ISQ column) against `llama.cpp:q8_0` and
`llama.cpp:q4_0` (GGUFs made once with llama.cpp's quantizer), e.g.

    decode_speed.py --dtypes float32 --prompt-lengths 128 --engines ruvllm:int8,llama.cpp:q8_0,ruvllm:int4,llama.cpp:q4_0 \
        --llama-cpp-python VENV/bin/python --out benchmarks/results/quant_speed.json

llama.cpp's own binaries (a -DGGML_NATIVE=ON build; --llama-cpp-bin DIR):
`llama-bench:f32`, `:bf16`, `:q8_0`, `:q4_0` run llama-bench on the same GGUF,
quantized by its llama-quantize, alternating with ruvllm in each round:

    decode_speed.py --dtypes float32 --prompt-lengths 128 \
        --engines ruvllm:int8,llama-bench:q8_0,ruvllm:int4,llama-bench:q4_0

Each round starts with a memory bandwidth probe (a 512 MB read on --threads
threads); the roofline column is that bandwidth over the weight bytes one
decode step reads (decode_engines.py's weight_bytes_per_token), and `% roof`
the decode rate against it. The JSON records the CPU's SIMD flags and the
kernel variant ruvllm picked (py_engine.kernels).

Prints a table and writes benchmarks/results/decode_speed.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from common import HERE, llama_cpp_bin, machine  # noqa: E402
RESULTS = HERE / "results" / "decode_speed.json"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--dtypes", type=csv, default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-lengths", type=lambda s: [int(x) for x in csv(s)], default=[128, 512])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--engines", type=csv, default=["ruvllm", "transformers"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-cpp-python", type=Path, default=None,
                   help="the python of an environment with llama-cpp-python, for the llama.cpp engine")
    p.add_argument("--llama-cpp-bin", type=Path, default=None,
                   help="llama.cpp's bin folder for llama-bench (default: what `make bench-anchors` built)")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args()


def run_child(engine: str, dtype: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    options = engine.partition(":")[2].split("+")
    if "thp" in options:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    if "keeplib" in options:  # library pages stay resident (py_engine.models.memory.release_library_pages)
        env["RUVLLM_KEEP_LIBRARY_PAGES"] = "1"
    defines = [o[1:] for o in options if o.startswith("D") and "=" in o]  # e.g. ruvllm:int8+DQ_ROWS8=4
    if defines:  # an A/B build of the kernels with these macros (py_engine.kernels.KERNEL_DEFINES)
        env["RUVLLM_KERNEL_DEFINES"] = " ".join(defines)
    python = sys.executable
    if engine.startswith("llama-bench"):
        env["RUVLLM_LLAMA_CPP_BIN"] = str(llama_cpp_bin(args.llama_cpp_bin))  # exits saying how to build it
    if engine.startswith("llama.cpp"):
        if args.llama_cpp_python is None:
            return {"engine": engine, "dtype": dtype, "error": ["--llama-cpp-python is needed for llama.cpp"]}
        python = str(args.llama_cpp_python)
    cmd = [python, str(HERE / "decode_engines.py"), engine, dtype, str(args.threads),
           str(args.new_tokens), *map(str, args.prompt_lengths)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"engine": engine, "dtype": dtype, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def summarize(runs: list[dict], args: argparse.Namespace) -> list[dict]:
    """Per engine and dtype: median, min and max of each metric over the rounds."""
    rows = []
    for dtype in args.dtypes:
        for engine in args.engines:
            ok = [r for r in runs if r["engine"] == engine and r["dtype"] == dtype and "error" not in r]
            row = {"engine": engine, "dtype": dtype, "runs": len(ok)}
            for n in map(str, args.prompt_lengths):
                for metric in ("prefill_tok_s", "decode_tok_s", "ttft_s"):
                    vals = [r[n][metric] for r in ok]
                    row[f"{metric}@{n}"] = {"median": statistics.median(vals), "min": min(vals),
                                            "max": max(vals)} if vals else None
            isq = [r["isq_s"] for r in ok if r.get("isq_s") is not None]
            row["isq_s"] = {"median": statistics.median(isq), "min": min(isq), "max": max(isq)} if isq else None
            roof = [r["bandwidth_gbs"] * 1e9 / r["weight_bytes_per_token"] for r in ok
                    if r.get("weight_bytes_per_token") and r.get("bandwidth_gbs")]
            row["roofline_tok_s"] = {"median": statistics.median(roof), "min": min(roof), "max": max(roof)} if roof else None
            row["weight_mb_per_token"] = (ok[0].get("weight_bytes_per_token") or 0) / 1e6 if ok else None
            rss = [r["peak_rss_mb"] for r in ok]
            row["peak_rss_mb"] = {"median": statistics.median(rss), "min": min(rss), "max": max(rss)} if rss else None
            for part in ("anon", "file"):  # the split at the largest sampled RSS (decode_engines.RssWatch)
                vals = [r["peak_split"][part] for r in ok if part in r.get("peak_split", {})]
                row[f"peak_{part}_mb"] = {"median": statistics.median(vals), "min": min(vals),
                                          "max": max(vals)} if vals else None
            rows.append(row)
    return rows


def paired_ratios(runs: list[dict], args: argparse.Namespace) -> list[dict]:
    """Each engine's decode and prefill over transformers' (and llama.cpp's) in the same round; a `ruvllm@OLD:opts`
    engine is the base of `ruvllm:opts` (the same options, new code against old)."""
    out = []
    old = lambda e: "@" in e.partition(":")[0]  # noqa: E731
    bases = [b for b in args.engines if b == "transformers" or b.startswith(("llama.cpp", "llama-bench")) or old(b)]
    for base, dtype in ((b, d) for b in bases for d in args.dtypes):
        for engine in (e for e in args.engines if e.startswith("ruvllm")):
            if old(base) and (old(engine) or engine.partition(":")[2] != base.partition(":")[2]):
                continue
            ratio: dict[str, float | None] = {}
            for n in map(str, args.prompt_lengths):
                for metric in ("decode_tok_s", "prefill_tok_s"):
                    pairs = [(a[n][metric], b[n][metric]) for a in runs for b in runs
                             if a["round"] == b["round"] and a["dtype"] == b["dtype"] == dtype
                             and a["engine"] == engine and b["engine"] == base
                             and "error" not in a and "error" not in b]
                    ratio[f"{metric}@{n}"] = statistics.median(x / y for x, y in pairs) if pairs else None
            out.append({"engine": engine, "dtype": dtype, "vs": base, "ratios": ratio})
    return out


def print_table(rows: list[dict], ratios: list[dict], args: argparse.Namespace) -> None:
    lengths = list(map(str, args.prompt_lengths))
    head = (["engine", "dtype"] + [f"prefill@{n}" for n in lengths] + [f"decode@{n}" for n in lengths]
            + [f"TTFT ms@{n}" for n in lengths] + ["peak RSS MB", "anon / file MB", "ISQ s", "MB/token", "roofline tok/s",
                                                   "% roof"])
    table = [head]
    for r in rows:
        cell = lambda key, scale=1.0, fmt="{:.1f}": spread(  # noqa: E731
            [r[key][k] * scale for k in ("median", "min", "max")] if r.get(key) else [], fmt)
        table.append([r["engine"], r["dtype"]] + [cell(f"prefill_tok_s@{n}") for n in lengths]
                     + [cell(f"decode_tok_s@{n}") for n in lengths]
                     + [cell(f"ttft_s@{n}", 1000, "{:.0f}") for n in lengths] + [cell("peak_rss_mb", fmt="{:.0f}")]
                     + [split_cell(r)] + [cell("isq_s")] + [f"{r['weight_mb_per_token']:.0f}" if r.get("weight_mb_per_token") else "-",
                                          cell("roofline_tok_s"), roof_share(r, lengths[0])])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    print("tok/s and ms: median [min-max] over the rounds")
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    for r in ratios:
        parts = [f"{k} x{v:.2f}" for k, v in r["ratios"].items() if v is not None]
        print(f"{r['engine']} {r['dtype']} vs {r['vs']} (paired): " + ", ".join(parts))


def split_cell(row: dict) -> str:
    """Median RssAnon / RssFile at the largest sampled RSS: weights copied in are anonymous, a mapped model's
    pages (llama.cpp's GGUF) and libraries are file pages."""
    anon, file = row.get("peak_anon_mb"), row.get("peak_file_mb")
    return f"{anon['median']:.0f} / {file['median']:.0f}" if anon and file else "-"


def roof_share(row: dict, length: str) -> str:
    decode, roof = row.get(f"decode_tok_s@{length}"), row.get("roofline_tok_s")
    return f"{100 * decode['median'] / roof['median']:.0f}%" if decode and roof else "-"


def bandwidth_gbs(threads: int) -> float:
    """Memory read bandwidth now: the best of 3 sums over 512 MB on `threads` threads (GB/s)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(128 * 1024 * 1024)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def main() -> None:
    args = parse_args()
    from decode_engines import build_model

    build_model()  # once, before any timing
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **machine()}
    runs: list[dict] = []
    for rnd in range(args.rounds):
        order = args.engines[rnd % len(args.engines):] + args.engines[:rnd % len(args.engines)]
        bandwidth = bandwidth_gbs(args.threads)
        print(f"round {rnd}: memory read bandwidth {bandwidth:.1f} GB/s", flush=True)
        for dtype in args.dtypes:
            for engine in order:
                start = time.perf_counter()
                result = {**run_child(engine, dtype, args), "round": rnd, "bandwidth_gbs": bandwidth}
                runs.append(result)
                brief = result.get("error") or {n: round(result[str(n)]["decode_tok_s"], 2)
                                                for n in args.prompt_lengths}
                print(f"round {rnd} {dtype} {engine}: decode tok/s {brief} ({time.perf_counter() - start:.0f} s)",
                      flush=True)
    meta["loadavg_end"] = os.getloadavg()
    rows, ratios = summarize(runs, args), paired_ratios(runs, args)
    print_table(rows, ratios, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"meta": meta, "config": config, "summary": rows, "ratios": ratios,
                                    "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
