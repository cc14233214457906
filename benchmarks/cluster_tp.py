"""Tensor parallelism on CPU (gloo on loopback): decode speed and per-rank memory, TP=1 against TP=2.

Part of benchmarks/cluster_bench.py (`--parts tp`). On its own, one memory probe:

    python benchmarks/cluster_tp.py --memory tiny-shakespeare 2

prints one JSON line: each rank's resident memory after loading and 16 decoded tokens (VmRSS), its peak
(VmHWM: every rank loads the whole checkpoint, then keeps its shard), and the bytes of tensors rank 0's
model holds. A fresh process per probe, so one configuration's memory never counts in another's.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO  # noqa: E402  (benchmarks/common.py: also puts the clone on sys.path)


def _status_mib(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = round(int(value.split()[0]) / 1024, 1)  # kB
    return out


def tensor_bytes(model) -> int:
    """Bytes of the distinct tensor storages a model holds: parameters, buffers, and tensors its modules keep
    in plain attributes and small objects (PackedWeight's codes and scales, a quantized head)."""
    import torch

    seen: dict[int, int] = {}
    visited: set[int] = set()

    def walk(value, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif depth and id(value) not in visited and not isinstance(value, (torch.nn.Module, str, bytes, type)):
            visited.add(id(value))
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                else vars(value).values() if hasattr(value, "__dict__") else ()
            for item in items:
                walk(item, depth - 1)

    for module in model.modules():
        for value in vars(module).values():
            walk(value, 3)
    return sum(seen.values())


def memory_probe(model: str, world: int) -> dict:
    """In this process: LLM(model[, tensor_parallel_size=world]), a short greedy decode, then each rank's memory."""
    import torch

    from py_engine import LLM, SamplingParams

    torch.set_num_threads(2 // world or 1)
    base = _status_mib(os.getpid())["VmRSS"]
    llm = LLM(model, tensor_parallel_size=world) if world > 1 else LLM(model)
    try:
        llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        pids = [os.getpid()]
        if world > 1:
            pids += [p.popen.pid for p in llm._parallel.workers.processes]
        ranks = [{"rank": r, **_status_mib(pid)} for r, pid in enumerate(pids)]
        return {"model": model, "world": world, "python+torch MiB": base, "ranks": ranks,
                "rank 0 tensors MiB": round(tensor_bytes(llm.model) / 2**20, 1)}
    finally:
        llm.close()


def memory_rows(model: str) -> list[dict]:
    rows = []
    for world in (1, 2):
        out = subprocess.run([sys.executable, __file__, "--memory", model, str(world)], cwd=REPO,
                             capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise RuntimeError(f"memory probe {model} TP={world} failed:\n{out.stderr[-3000:]}")
        probe = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"model": model, "config": f"TP={world}", "rank 0 tensors MiB": probe["rank 0 tensors MiB"],
                     "RSS MiB per rank": " / ".join(str(r["VmRSS"]) for r in probe["ranks"]),
                     "peak MiB per rank": " / ".join(str(r["VmHWM"]) for r in probe["ranks"]),
                     "python+torch MiB": probe["python+torch MiB"]})
        print(rows[-1], flush=True)
    return rows


def speed_rows(model: str, rounds: int, tokens: int) -> list[dict]:
    """Single-sequence greedy decode tok/s, TP=1 on 2 threads against TP=2 on 1 thread each, alternating."""
    import torch

    from py_engine import LLM, SamplingParams

    torch.set_num_threads(2)
    one = LLM(model)
    two = LLM(model, tensor_parallel_size=2)  # sets this process to 1 thread (its share of 2 cores)
    speeds: dict[str, list[float]] = {"TP=1, 2 threads": [], "TP=2, 1 thread each": []}
    try:
        for llm, threads in ((one, 2), (two, 1)):  # warm-up: kernel plans, caches
            torch.set_num_threads(threads)
            llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8))
        for r in range(rounds):
            order = [("TP=1, 2 threads", one, 2), ("TP=2, 1 thread each", two, 1)]
            for name, llm, threads in (order if r % 2 == 0 else order[::-1]):
                torch.set_num_threads(threads)  # kernel_step gives the kernels' pool this many threads
                backend = llm._new_backend()
                logits = backend.prefill(llm.encode("Once upon a time"))
                start = time.perf_counter()
                for _ in range(tokens):
                    logits = backend.decode(int(logits.argmax()))
                speeds[name].append(tokens / (time.perf_counter() - start))
                print(f"{model} round {r} {name}: {speeds[name][-1]:.1f} tok/s", flush=True)
    finally:
        two.close()
    base = statistics.median(speeds["TP=1, 2 threads"])
    return [{"model": model, "config": name, "decode tok/s (median)": round(statistics.median(values), 1),
             "x TP=1": round(statistics.median(values) / base, 2), "range": "%.1f-%.1f" % (min(values), max(values))}
            for name, values in speeds.items()]


def part_tp(models: list[str], rounds: int, tokens: int) -> tuple[list[dict], list[dict]]:
    speed, memory = [], []
    for model in models:
        speed += speed_rows(model, rounds, tokens)
        memory += memory_rows(model)
    return speed, memory


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--memory":
        print(json.dumps(memory_probe(sys.argv[2], int(sys.argv[3]))))
    else:
        sys.exit(__doc__)
