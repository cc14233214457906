"""SmolLM2-135M-Instruct's Q4_1 GGUF: ruvllm's torch engine against llama.cpp's own llama-bench, same file.

    .venv/bin/python benchmarks/smollm2_speed.py                       # 3 rounds, prompt 512, 128 new tokens
    .venv/bin/python benchmarks/smollm2_speed.py --rounds 5 --threads 2 --prompt 128 --new-tokens 64

Each round runs both engines in turn (the order alternates), each in a fresh process, on 2 threads:
- ruvllm: `LLM("smollm2-135m-instruct")`'s path, the Q4_1 codes as QuantLinear on the CPU kernels
  (optimize_for_cpu; decode with int8 activations, the default), a prompt of the first N tokens of the
  built-in validation split: prefill tok/s = N / time to first token, decode tok/s over the new tokens
  after the first;
- llama.cpp: `llama-bench -p N -n M -t THREADS -r 1` (`make bench-anchors` builds it):
  its pp (prefill) and tg (decode) rates.

Prints a table of per-round rates and the median ratios ruvllm / llama.cpp; writes
benchmarks/results/smollm2_speed.json with the CPU flags and the load average.
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

from common import REPO  # noqa: E402  (also puts the clone's root on sys.path)

RESULTS = REPO / "benchmarks" / "results" / "smollm2_speed.json"
TEXT = REPO / "py_engine" / "data" / "tiny-shakespeare" / "validation.txt"
NAME = "smollm2-135m-instruct"


def gguf_path() -> Path:
    from py_engine.hub.resolve import _alias_gguf, load_aliases

    return _alias_gguf(load_aliases()[NAME], None)


def ruvllm_child(threads: int, prompt: int, new_tokens: int) -> dict:
    """In the child process: load, then one timed prefill + decode (after one untimed warm-up)."""
    import torch

    torch.set_num_threads(threads)
    from py_engine.backends.torch import LLM

    start = time.perf_counter()
    llm = LLM(NAME, device="cpu")
    load_s = time.perf_counter() - start
    ids = llm.tokenizer.encode(TEXT.read_text(encoding="utf-8")[: prompt * 16], add_special_tokens=False)[:prompt]
    backend = llm._new_backend()
    backend.argmax(backend.prefill(ids[:16]))  # warm-up: kernels built, caches allocated
    t0 = time.perf_counter()
    tokens = [backend.argmax(backend.prefill(ids))]
    t1 = time.perf_counter()
    while len(tokens) < new_tokens:
        tokens.append(backend.argmax(backend.decode(tokens[-1])))
    t2 = time.perf_counter()
    return {"load_s": load_s, "prefill_tps": len(ids) / (t1 - t0), "decode_tps": (new_tokens - 1) / (t2 - t1)}


def run_ruvllm(threads: int, prompt: int, new_tokens: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, __file__, "--child", str(threads), str(prompt), str(new_tokens)],
                          capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"ruvllm child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_llama_bench(binary: Path, gguf: Path, threads: int, prompt: int, new_tokens: int, passive: bool) -> dict:
    """passive: llama.cpp's threads sleep rather than spin while waiting (--poll 0, OMP_WAIT_POLICY=passive),
    which a shared, overloaded machine needs (spinning threads lost up to 10x there)."""
    if not binary.is_file():
        raise SystemExit(f"{binary} is missing: build llama.cpp as benchmarks/README.md says or pass --llama-bench")
    extra, env = (["--poll", "0"], {**os.environ, "OMP_WAIT_POLICY": "passive"}) if passive else ([], None)
    done = subprocess.run([str(binary), "-m", str(gguf), "-p", str(prompt), "-n", str(new_tokens), "-t", str(threads),
                           "-r", "1", "-o", "json", *extra], capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode != 0:
        raise SystemExit(f"llama-bench failed:\n{done.stderr[-3000:]}")
    rows = json.loads(done.stdout)
    pp = next(r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return {"prefill_tps": pp["avg_ts"], "decode_tps": tg["avg_ts"], "build": pp.get("build_commit"),
            "cpu_info": pp.get("cpu_info"), "type": pp.get("model_type")}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(ruvllm_child(*map(int, sys.argv[2:5]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--llama-bench", type=Path, help="default: the build of `make bench-anchors`")
    parser.add_argument("--passive", action="store_true",
                        help="llama.cpp's threads sleep while waiting (--poll 0, OMP_WAIT_POLICY=passive): for a loaded machine")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    from common import llama_tool, machine

    gguf = gguf_path()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": gguf.name, "threads": args.threads,
            "prompt": args.prompt, "new_tokens": args.new_tokens, "llama_cpp_passive": args.passive, **machine()}
    runs = []
    print("| round | engine | prefill tok/s | decode tok/s |\n| --- | --- | --- | --- |")
    for r in range(args.rounds):
        order = ("ruvllm", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "ruvllm")
        for engine in order:
            got = (run_ruvllm(args.threads, args.prompt, args.new_tokens) if engine == "ruvllm" else
                   run_llama_bench(args.llama_bench or llama_tool("llama-bench"), gguf, args.threads, args.prompt, args.new_tokens, args.passive))
            runs.append({"round": r, "engine": engine, "loadavg": os.getloadavg()[0], **got})
            print(f"| {r} | {engine} | {got['prefill_tps']:.1f} | {got['decode_tps']:.1f} |", flush=True)
    summary = {}
    for what in ("prefill_tps", "decode_tps"):
        ours = {x["round"]: x[what] for x in runs if x["engine"] == "ruvllm"}
        theirs = {x["round"]: x[what] for x in runs if x["engine"] == "llama.cpp"}
        summary[what] = {"ruvllm": statistics.median(ours.values()), "llama.cpp": statistics.median(theirs.values()),
                         "ratio": statistics.median(ours[k] / theirs[k] for k in ours)}
        s = summary[what]
        print(f"{what}: ruvllm {s['ruvllm']:.1f}, llama.cpp {s['llama.cpp']:.1f}, paired median ratio x{s['ratio']:.2f}")
    meta["loadavg_end"] = os.getloadavg()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
