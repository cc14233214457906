"""Prefill only, one K-quant GGUF: ruvllm, ruvllm with other settings (an A/B build) and llama-bench's pp, alternating.

    .venv/bin/python benchmarks/kquant_prefill_ab.py --model llama1b --quant Q6_K --rounds 3 --passive \
        --baseline-env "RUVLLM_KERNEL_DEFINES=Q6_FOLD=0"

kquant_speed.py's files (made there, under benchmarks/.cache). Each round runs, in alternating order, a fresh
ruvllm process (load, optimize_for_cpu, a warm-up, then `--repeat` prefills of the prompt: the fastest one's
wall time, and its CPU time), the same with --baseline-env's settings (`ruvllm-base`), and `llama-bench -p P -n 0
-r REPEAT` (its mean). The ratios are paired per round (median [min-max]); the JSON (benchmarks/results/) records
the load average before and after and each prefill's first greedy token.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import HERE, llama_cpp_bin, machine  # noqa: E402  (also puts the clone's root on sys.path)
from kquant_speed import model_file, spread  # noqa: E402

RESULTS = HERE / "results" / "kquant_prefill_ab.json"


def child(path: str, prompt: int, threads: int, repeat: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from py_engine.backends.torch import TorchBackend
    from py_engine.cpu.transforms import optimize_for_cpu
    from py_engine.hub import resolve_model
    from py_engine.models import load_model

    model, config = load_model(resolve_model(path, str(HERE / ".cache" / "ruvllm-cache")))
    optimize_for_cpu(model)
    backend = TorchBackend(model, config, prompt + 16)
    ids = [(i * 7919) % (config.vocab_size - 300) + 100 for i in range(prompt)]  # kquant_speed.py's prompt
    backend.argmax(backend.prefill(ids[:8]))  # warm-up
    runs = []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        token = backend.argmax(backend.prefill(ids))
        runs.append((time.perf_counter() - t0, time.process_time() - c0, token))
    wall, cpu, token = min(runs)
    return {"prefill_tok_s": prompt / wall, "cpu_s": cpu, "token": token}


def run_ours(path: Path, args, env: dict | None) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", str(path), str(args.prompt), str(args.threads),
                           str(args.repeat)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(args.threads), **(env or {})})
    if done.returncode:
        raise SystemExit(f"ruvllm on {path.name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_llama(path: Path, args) -> dict:
    extra, env = (["--poll", "0"], {**os.environ, "OMP_WAIT_POLICY": "passive"}) if args.passive else ([], None)
    done = subprocess.run([str(args.llama_cpp_bin / "llama-bench"), "-m", str(path), "-p", str(args.prompt), "-n", "0",
                           "-t", str(args.threads), "-r", str(args.repeat), "-o", "json", *extra],
                          capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"llama-bench on {path.name} failed:\n{done.stderr[-3000:]}")
    return {"prefill_tok_s": json.loads(done.stdout)[0]["avg_ts"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama1b", choices=["smollm2", "llama1b"])
    parser.add_argument("--quant", default="Q6_K")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--llama-cpp-bin", type=Path, help="llama.cpp's bin folder (default: `make bench-anchors`'s)")
    parser.add_argument("--passive", action="store_true", help="llama.cpp's threads sleep while waiting (--poll 0)")
    parser.add_argument("--baseline-env", default="", help="ruvllm-base's VAR=VALUE settings")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.llama_cpp_bin = llama_cpp_bin(args.llama_cpp_bin)
    base = dict(item.split("=", 1) for item in args.baseline_env.split()) if args.baseline_env else None
    info, path = machine(), model_file(args.model, args.quant, args.llama_cpp_bin)
    rounds = []
    for r in range(args.rounds):
        order = ["ruvllm", "llama"] + (["ruvllm-base"] if base else [])
        result = {}
        for engine in order if r % 2 == 0 else order[::-1]:
            result[engine] = run_llama(path, args) if engine == "llama" else \
                run_ours(path, args, base if engine == "ruvllm-base" else None)
        rounds.append(result)
        print(f"round {r + 1}: " + ", ".join(f"{e} {v['prefill_tok_s']:.1f} tok/s" for e, v in result.items()),
              flush=True)
    info["loadavg_end"] = os.getloadavg()
    pp = lambda e: [x[e]["prefill_tok_s"] for x in rounds]  # noqa: E731
    ratio = lambda e: spread([a / b for a, b in zip(pp("ruvllm"), pp(e))])  # noqa: E731 (paired per round)
    lines = [f"{args.model} {args.quant}, prompt {args.prompt}, {args.threads} threads: ruvllm "
             f"{statistics.median(pp('ruvllm')):.1f} tok/s, llama-bench {statistics.median(pp('llama')):.1f}, "
             f"ratio {ratio('llama')}"]
    if base:
        lines.append(f"ruvllm-base {statistics.median(pp('ruvllm-base')):.1f} tok/s; ruvllm / base "
                     f"{ratio('ruvllm-base')}, CPU time base / ruvllm "
                     f"{spread([x['ruvllm-base']['cpu_s'] / x['ruvllm']['cpu_s'] for x in rounds])}")
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                    "file": str(path), "rounds": rounds}, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))))
    else:
        main()
