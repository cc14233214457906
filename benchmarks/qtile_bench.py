"""The quantized kernels per rows of x: qtile.c's virtual panels against qpanel.c's packed panels.

    python benchmarks/qtile_bench.py [--rows 1,4,16,32,64,128] [--rounds 3] [--threads 1]
        [--variant NAME[@TREE]=DEFINES ...] [--out benchmarks/results/qtile_bench.json]

Each variant is the kernels built with RUVLLM_KERNEL_DEFINES=DEFINES (e.g. `Q_PANELS=0` keeps every count of
rows in qtile.c, `Q_PANEL_ROWS=8` sends batches of 8+ rows to the panels: both give the same bits), run in
its own process, with py_engine from TREE when given (another checkout, e.g. `git archive main`
unpacked: old against new); the variants alternate round by round and the best round counts. Shapes: gate/up
4864x896 and down 896x4864 (Qwen2.5-0.5B), int4 groups of 32 (Q4_0's layout) and int8 groups of 32
(Q8_0's), then int4 g128 and per-channel int8 (`ruvllm quantize`'s defaults). GFLOP/s-equivalent = 2 * rows * N * K / time. The JSON records the CPU's flags.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPES = [(4864, 896), (896, 4864)]
# Q4_0 / Q8_0's layouts (GGUF imports), then `ruvllm quantize`'s defaults: int4 g128 asymmetric, int8 per channel
LAYOUTS = [("int4 g32", 4, 32, False), ("int8 g32", 8, 32, True), ("int4 g128", 4, 128, False), ("int8 pc", 8, None, True)]
DEFAULT_VARIANTS = ["routed=", "tiles=Q_PANELS=0", "panels8=Q_PANEL_ROWS=8"]


def child(rows: list[int], threads: int, root: str) -> None:
    import statistics

    import torch

    sys.path.insert(0, root)
    from py_engine.kernels import cpu_kernels
    from py_engine.quant.linear import QuantLinear
    from py_engine.quant.transform import rtn

    torch.set_num_threads(1)
    cpu_kernels().set_threads(threads)
    g = torch.Generator().manual_seed(0)
    out = {}
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g) * 0.02
        for name, bits, group, symmetric in LAYOUTS:
            layer = QuantLinear.from_weight(rtn(w, bits, group, symmetric))
            for m in rows:
                x = torch.randn(m, k, generator=g)
                with torch.inference_mode():
                    layer(x)
                    times, start = [], time.perf_counter()
                    while len(times) < 200 and (len(times) < 5 or time.perf_counter() - start < 0.4):
                        t = time.perf_counter()
                        layer(x)
                        times.append(time.perf_counter() - t)
                out[f"{name} {n}x{k} rows {m}"] = 2 * m * n * k / statistics.median(times) / 1e9
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,32,64,128")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variant", action="append", help="NAME=DEFINES (space-separated -D names)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "qtile_bench.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", default=str(Path(__file__).resolve().parent.parent), help=argparse.SUPPRESS)
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:
        child(rows, args.threads, args.root)
        return
    variants = [v.split("=", 1) for v in (args.variant or DEFAULT_VARIANTS)]
    best: dict[str, dict[str, float]] = {name: {} for name, _ in variants}
    for _ in range(args.rounds):
        for name, defines in variants:
            root = name.split("@", 1)[1] if "@" in name else str(Path(__file__).resolve().parent.parent)
            env = dict(os.environ, RUVLLM_KERNEL_DEFINES=defines, OMP_NUM_THREADS="1")
            res = subprocess.run([sys.executable, __file__, "--child", "--rows", args.rows,
                                  "--threads", str(args.threads), "--root", root], env=env, check=True,
                                 capture_output=True, text=True)
            for key, v in json.loads(res.stdout.strip().splitlines()[-1]).items():
                best[name][key] = max(best[name].get(key, 0.0), v)
    keys = list(next(iter(best.values())))
    print(f"{'GFLOP/s-equivalent':34s}" + "".join(f"{name.split('@')[0]:>12s}" for name, _ in variants))
    for key in keys:
        print(f"{key:34s}" + "".join(f"{best[name][key]:12.1f}" for name, _ in variants))
    from common import machine  # CPU model, ISA flags, the kernel variant, load average, commit

    meta = {**machine(), "threads": args.threads, "rounds": args.rounds, "variants": dict(variants),
            "loadavg_end": os.getloadavg(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "gflops": best}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
