"""The memory read ceiling a memory-bound decode step runs against, and how close decode gets to it.

    python benchmarks/mem_bandwidth.py [--mb 1024] [--threads 2] [--reps 5] [--decode RESULTS.json ...]

Builds mem_bandwidth.c (cc -O2 -march=native) and streams a buffer of --mb megabytes on --threads
threads: two contiguous halves or 512 KiB chunks claimed from a shared counter (as the kernels' pool
splits a GEMV), 256- or 512-bit loads, with and without software prefetch, in 4 KiB pages
(MADV_NOHUGEPAGE) and in 2 MiB pages (MADV_HUGEPAGE), the two alternating within each case. It reports
the best and median wall-clock GB/s, and the median over CPU time (GB/s while the threads run: on a
shared machine, time slicing lowers the wall-clock figure, not this one).

--decode: decode_speed.py result files; each engine's effective bandwidth (median decode tok/s times the
weight bytes one step reads) is printed as a share of the ceiling (the best case's wall-clock or CPU-time
rate, whichever is higher), with the probe decode_speed took in those rounds.

Prints a table and writes benchmarks/results/mem_bandwidth.json (with the CPU's flags).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "mem_bandwidth.json"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=1024, help="buffer size, 16-65536 MB (two buffers are held)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--decode", type=Path, nargs="*", default=[], help="decode_speed.py JSON results to compare")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args()


def measure(args: argparse.Namespace) -> list[dict]:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        sys.exit("mem_bandwidth.py needs a C compiler (cc or gcc)")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "mem_bandwidth"
        subprocess.run([compiler, "-O2", "-march=native", "-pthread", str(HERE / "mem_bandwidth.c"), "-o", str(exe)],
                       check=True)
        done = subprocess.run([str(exe), str(args.mb), str(args.threads), str(args.reps)], check=True,
                              capture_output=True, text=True)
    rows = []
    for line in done.stdout.splitlines():
        split, width, prefetch, pages, best, median, cpu, huge_kb = line.split()
        rows.append({"split": split, "load_bits": int(width), "prefetch_bytes": int(prefetch), "pages": pages,
                     "gb_s_best": float(best), "gb_s_median": float(median), "gb_s_cpu": float(cpu),
                     "huge_kb": int(huge_kb)})
    return rows


def decode_rates(paths: list[Path]) -> list[dict]:
    """Per engine and dtype of each file: decode tok/s and the GB/s it streams (tok/s x weight bytes)."""
    out = []
    for path in paths:
        data = json.loads(path.read_text())
        groups: dict[tuple[str, str], list[dict]] = {}
        for run in data["runs"]:
            if "error" not in run and run.get("weight_bytes_per_token"):
                groups.setdefault((run["engine"], run["dtype"]), []).append(run)
        for (engine, dtype), runs in groups.items():
            n = next(k for k in runs[0] if k.isdigit())
            tok_s = statistics.median(r[n]["decode_tok_s"] for r in runs)
            out.append({"file": path.name, "engine": engine, "dtype": dtype, "threads": runs[0].get("threads"),
                        "decode_tok_s": tok_s, "gb_per_token": runs[0]["weight_bytes_per_token"] / 1e9,
                        "gb_s": tok_s * runs[0]["weight_bytes_per_token"] / 1e9,
                        "probe_gb_s": statistics.median(r.get("bandwidth_gbs", 0.0) for r in runs)})
    return out


def main() -> None:
    args = parse_args()
    from common import machine  # CPU model, ISA flags, kernel variant, load, commit

    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **machine()}
    rows = measure(args)
    meta["loadavg_end"] = os.getloadavg()
    print(f"{args.mb} MB read on {args.threads} threads, {args.reps} reps per case; load {meta['loadavg_start']}")
    print(f"{'split':7} {'load':>5} {'prefetch':>8} {'pages':>5} {'best GB/s':>9} {'median':>7} {'CPU-time':>8} "
          f"{'huge MB':>7}")
    for r in rows:
        print(f"{r['split']:7} {r['load_bits']:>5} {r['prefetch_bytes']:>8} {r['pages']:>5} {r['gb_s_best']:>9.1f} "
              f"{r['gb_s_median']:>7.1f} {r['gb_s_cpu']:>8.1f} {r['huge_kb'] // 1024:>7}")
    decode = decode_rates(args.decode)
    if decode:
        ceiling = max(max(r["gb_s_best"], r["gb_s_cpu"]) for r in rows)  # quiet: the two agree; shared: CPU time
        print(f"\ndecode against the best streaming read here ({ceiling:.1f} GB/s, wall clock or CPU time):")
        print(f"{'file':40} {'engine':18} {'dtype':9} {'tok/s':>6} {'GB/token':>8} {'GB/s':>6} {'% ceiling':>9} "
              f"{'probe':>6}")
        for d in decode:
            print(f"{d['file'][:40]:40} {d['engine']:18} {d['dtype']:9} {d['decode_tok_s']:>6.1f} "
                  f"{d['gb_per_token']:>8.2f} {d['gb_s']:>6.1f} {100 * d['gb_s'] / ceiling:>8.0f}% "
                  f"{d['probe_gb_s']:>6.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "config": {"mb": args.mb, "threads": args.threads,
                                                             "reps": args.reps},
                                    "reads": rows, "decode": decode}, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
