"""Quantized matmul kernels on Qwen2.5-0.5B's shapes: torch's own ops against py_engine's.

    python benchmarks/quant_kernels.py [--threads 2] [--rows 1,128] [--out benchmarks/results/quant_kernels.json]

Per shape (N x K: q/o 896x896, k/v 128x896, gate/up 4864x896, down 896x4864,
LM head 151936x896) and rows of x (1: a decode GEMV, 128: a prefill GEMM),
the median time of
- `fp32`: py_engine's fp32 kernel (the unquantized baseline) and torch's F.linear;
- `torch int8pack`: `aten._weight_int8pack_mm` (bf16 x; fp32 x measured ~1 GB/s);
- `torch int4pack`: `aten._convert_weight_to_int4pack_for_cpu` + `_weight_int4pack_mm_for_cpu` (bf16 x, g128);
- `torch _int_mm`: int8 x int8 -> int32 (x quantized beforehand, at least 17 rows);
- `ruvllm int8` / `ruvllm int4 g128`: py_engine.quant's QuantLinear (x rounded to int8 per 32
  values in decode), and `... exact`, the fp32 dequantize-then-FMA path.
GB/s (one row) counts the weight bytes each reads once (fp32 4, int8 1, int4 0.5 per weight,
scales aside); with more rows, GFLOP/s. The small shapes stay in the 32 MB L3 between repetitions, so only the LM head shows
what streaming from memory allows; benchmarks/decode_speed.py measures whole tokens.
torch runs on --threads OpenMP threads, py_engine's kernels on their own pool of as many.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import common  # noqa: E402,F401  (puts the clone's root on sys.path)
from py_engine.kernels import cpu_kernels  # noqa: E402
from py_engine.quant.linear import QuantLinear  # noqa: E402
from py_engine.quant.transform import rtn  # noqa: E402

SHAPES = [(896, 896), (128, 896), (4864, 896), (896, 4864), (151936, 896)]


def median_time(fn, budget: float = 0.6, most: int = 200) -> float:
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < most and (len(times) < 3 or time.perf_counter() - start < budget):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def torch_threads(n: int):
    """Run fn with torch on n threads (its ops), restoring 1 afterwards (our kernels' setting)."""
    def wrap(fn):
        def run():
            torch.set_num_threads(n)
            try:
                return fn()
            finally:
                torch.set_num_threads(1)
        return run
    return wrap


def measure_shape(n: int, k: int, rows: int, threads: int) -> dict:
    kernels = cpu_kernels()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    x = torch.randn(rows, k, generator=g)
    xb = x.bfloat16()
    out: dict[str, dict] = {}

    def record(name: str, seconds: float, weight_bytes: float) -> None:
        out[name] = {"ms": seconds * 1e3, "GB/s": weight_bytes / seconds / 1e9,
                     "GFLOP/s": 2 * rows * n * k / seconds / 1e9}

    if kernels is not None:
        record("fp32 (ruvllm kernel)", median_time(lambda: kernels.linear(x, w)), 4 * n * k)
    record("fp32 (torch F.linear)", median_time(torch_threads(threads)(lambda: F.linear(x, w))), 4 * n * k)
    w8 = rtn(w, 8, None, True)
    int8 = (w8.codes.to(torch.int16) - 128).to(torch.int8).contiguous()
    scales = w8.scales[:, 0].bfloat16()
    record("torch int8pack (bf16 x)", median_time(torch_threads(threads)(
        lambda: torch.ops.aten._weight_int8pack_mm(xb, int8, scales))), n * k)
    w4 = rtn(w, 4, 128, False)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w4.codes[:, :k].to(torch.int32).contiguous(), 1)
    s4 = w4.scales
    zeros = (8.0 - w4.zero_points.float()) * s4
    sz = torch.stack([s4, zeros], -1).transpose(0, 1).contiguous().bfloat16()  # [K / 128, N, 2]
    record("torch int4pack g128 (bf16 x)", median_time(torch_threads(threads)(
        lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, 128, sz))), n * k / 2)
    xi = torch.randint(-127, 128, (max(rows, 17), k), dtype=torch.int8, generator=g)
    if n * k <= 1 << 23:  # ~1.5 GOP/s: the LM head would take seconds a call
        record(f"torch _int_mm ({max(rows, 17)} rows)", median_time(torch_threads(threads)(
            lambda: torch._int_mm(xi, int8.t())), budget=0.3, most=5), n * k)
    for name, q in (("ruvllm int8", w8), ("ruvllm int4 g128", w4)):
        layer = QuantLinear.from_weight(q)
        weight_bytes = n * k * (1 if q.bits == 8 else 0.5)
        with torch.inference_mode():
            record(name, median_time(lambda: layer(x)), weight_bytes)
            record(name + " (bf16 x)", median_time(lambda: layer(xb)), weight_bytes)
            if rows < 16:
                layer.int8_activations = False
                record(name + " exact", median_time(lambda: layer(x)), weight_bytes)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,128")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "quant_kernels.json")
    args = p.parse_args()
    kernels = cpu_kernels()
    if kernels is not None:
        kernels.set_threads(args.threads)
    torch.set_num_threads(1)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for n, k in SHAPES:
            if rows > 1 and n > 100000:
                continue  # prefill runs the head on one row (last_only)
            row = {"rows": rows, "shape": f"{n}x{k}", "results": measure_shape(n, k, rows, args.threads)}
            results.append(row)
            print(f"rows {rows} {n}x{k}:")
            for name, r in row["results"].items():
                rate = f"{r['GB/s']:6.1f} GB/s" if rows == 1 else f"{r['GFLOP/s']:6.1f} GFLOP/s"
                print(f"  {name:32s} {r['ms']:9.3f} ms  {rate}")
    from common import machine  # CPU model, ISA flags, the kernel variant, load average, commit

    meta = {**machine(), "threads": args.threads, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
