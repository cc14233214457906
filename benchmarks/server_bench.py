"""Issue 6's server report, end to end: throughput per concurrency, KV utilization and capacity, prefix caching.

    python benchmarks/server_bench.py [--models builtin qwen0.5b] [--levels 1,4,16,64]

For the built-in model and a random-weight model with Qwen2.5-0.5B's shape
(both float32: this CPU has no bf16 instructions), it measures:
  1. aggregate output tok/s of `ruvllm serve` at each concurrency level, over
     streaming HTTP (native_server.bench.loadgen), and the server's peak RSS;
  2. KV utilization at peak concurrency: slots holding a computed token over
     slots of the blocks held, read from the block manager after every step
     of an in-process engine running the same load at the top level;
  3. KV capacity: how many seq_len-token sequences a budget of K contiguous
     max_position_embeddings slabs holds when paged, from the block manager's
     accounting and by letting a real engine's scheduler admit all it can;
  4. TTFT for a repeated system prompt, prefix caching on vs off: two servers
     up at once, requests alternating between them (this machine is noisy).
Servers bind 127.0.0.1 on free ports and stop at the end. Writes
benchmarks/results/server_bench.json and prints the tables. The built-in
model's context is 256 tokens, so its "1k" lengths are scaled down to fit.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from common import REPO  # noqa: E402  (also puts the clone's root on sys.path)

from native_server.bench.capacity import admit_all, kv_capacity  # noqa: E402
from native_server.bench.loadgen import run_level_sync  # noqa: E402
from native_server.bench.offline import occupancy_at_peak, run_engine  # noqa: E402
from native_server.bench.report import flatten, format_table  # noqa: E402
from native_server.bench.stats import summarize  # noqa: E402
from native_server.bench.workload import Workload, random_prompts  # noqa: E402
from tests.server.server_harness import free_port, http_process  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "server_bench.json"
QWEN_DIR = REPO / "benchmarks" / ".cache" / "qwen2.5-0.5b-random-seed0-serve"
QWEN_TOKENIZER = REPO.parent / "shared" / "fixtures" / "tokenizers" / "qwen2.5"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
STARTUP_S, STOP_S = 300.0, 60.0


@dataclass(frozen=True)
class Plan:
    """What to measure on one model (lengths in tokens)."""

    path: str
    prompt_len: int = 128
    gen_len: int = 64
    iterations: int = 2  # requests per level = level x iterations
    system_prompt_len: int = 1024  # the repeated prefix of the prefix-caching A/B
    prefix_rounds: int = 4  # A/B pairs after the warm-up request
    capacity_seq_len: int = 1024
    capacity_slabs: int = 2  # the budget: this many contiguous max-length sequences
    run_capacity: bool = False  # also run the admitted sequences through the model (cheap models only)


def qwen_checkpoint() -> Path:
    """decode_engines.py's random Qwen2.5-0.5B-shape weights (float32, built once), as a servable folder:
    the same files linked, plus Qwen2.5's real tokenizer from ../shared (a toy one where that is absent)."""
    from decode_engines import build_model

    weights = build_model()
    QWEN_DIR.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        with contextlib.suppress(FileExistsError):
            (QWEN_DIR / name).symlink_to(weights / name)
    if not (QWEN_DIR / "tokenizer.json").exists():
        if QWEN_TOKENIZER.is_dir():
            for name in TOKENIZER_FILES:
                shutil.copy(QWEN_TOKENIZER / name, QWEN_DIR / name)
        else:
            from tests.tiny_models import train_tokenizer

            train_tokenizer(QWEN_DIR)
    (QWEN_DIR / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    return QWEN_DIR


def plans(names: list[str]) -> dict[str, Plan]:
    known = {
        "builtin": lambda: Plan(str(REPO / "py_engine" / "data" / "tiny-shakespeare"), system_prompt_len=192,
                                prefix_rounds=6, capacity_seq_len=128, capacity_slabs=16, run_capacity=True),
        "qwen0.5b": lambda: Plan(str(qwen_checkpoint()), prompt_len=128, gen_len=128, iterations=1,
                                 prefix_rounds=3),
    }
    # Any other name is a model folder, measured with short lengths (for trying the script on a tiny model).
    other = lambda path: Plan(path, system_prompt_len=96, capacity_seq_len=32, run_capacity=True)  # noqa: E731
    return {name: known[name]() if name in known else other(name) for name in names}


# --- servers -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def serve(model: str, *flags: str, log: Path, checkout: Path | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`ruvllm serve MODEL` on a free 127.0.0.1 port; yields (url, process), SIGTERM at the end.
    checkout: another source tree of ruvllm (e.g. `git archive main`) to serve with this environment's packages."""
    port = free_port()
    cli = ["-m", "ruvllm_cli"] if checkout is None else [
        "-c", f"import sys; sys.path.insert(0, {str(Path(checkout).resolve())!r}); from ruvllm_cli.main import main; "
              "sys.exit(main())"]
    command = [sys.executable, *cli, "serve", model, "--host", "127.0.0.1", "--port", str(port),
               "--device", "cpu", "--dtype", "float32", "--log-level", "warning", *flags]
    url = f"http://127.0.0.1:{port}"
    with http_process(command, url, "/health", log, startup_s=STARTUP_S, stop_s=STOP_S) as process:
        yield url, process


def peak_rss_mib(pid: int) -> float:
    """VmHWM of a running process: its peak resident set."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# --- the four measurements -------------------------------------------------------------------------------
def throughput(plan: Plan, levels: list[int], vocab: int, logs: Path) -> dict[str, Any]:
    workload = Workload(plan.prompt_len, plan.gen_len)
    rows = []
    with serve(plan.path, "--max-concurrent", str(max(levels)), log=logs / "throughput.log") as (url, process):
        run_level_sync(url, workload.prompts(2, vocab, "warmup"), plan.gen_len, 1)
        for level in levels:
            timings = run_level_sync(url, workload.prompts(level * plan.iterations, vocab, f"c{level}"),
                                     plan.gen_len, level)
            result = summarize(timings, level)
            rows.append({"concurrency": level, "prompt_len": plan.prompt_len, "gen_len": plan.gen_len,
                         **flatten(result.to_dict())})
            print(format_table(rows[-1:]), flush=True)
        rss = peak_rss_mib(process.pid)
    for row in rows:
        row["speedup"] = row["output_throughput"] / rows[0]["output_throughput"]
    return {"rows": rows, "server_peak_rss_mib": rss}


def _engine(plan: Plan, **kwargs: Any) -> Any:
    from native_server.engine.llm_engine import LLMEngine

    return LLMEngine(plan.path, dtype="float32", device="cpu", **kwargs)


def kv_utilization(plan: Plan, level: int, vocab: int) -> dict[str, Any]:
    engine = _engine(plan, max_num_seqs=level)
    occupancy: list = []
    prompts = Workload(plan.prompt_len, plan.gen_len).prompts(level, vocab, "kv")
    run_engine(engine, prompts, plan.gen_len, level, occupancy)
    peak = occupancy_at_peak(occupancy)
    overall = sum(s.tokens_held for s in occupancy) / max(sum(s.slots_reserved for s in occupancy), 1)
    return {"concurrency": level, "peak_running": peak.running, "utilization_at_peak": peak.utilization,
            "utilization_all_steps": overall, "block_size": engine.kv.block_size,
            "pool_use_at_peak": peak.tokens_held / peak.slots_total}


def capacity(plan: Plan, vocab: int) -> dict[str, Any]:
    import torch

    from py_engine.config import ModelConfig

    config = ModelConfig.from_file(plan.path)
    one_slab = kv_capacity(config, torch.float32, 16, plan.capacity_seq_len, 0).bytes_per_token
    budget = plan.capacity_slabs * one_slab * config.max_position_embeddings
    cap = kv_capacity(config, torch.float32, 16, plan.capacity_seq_len, budget)
    count = cap.paged_seqs + 4
    engine = _engine(plan, kv_cache_memory=budget, max_num_seqs=count,
                     max_num_batched_tokens=count * plan.capacity_seq_len)
    admitted, waiting = admit_all(engine, plan.capacity_seq_len, count, vocab)
    out = {**cap.to_dict(), "submitted": count, "admitted_by_scheduler": admitted, "left_waiting": waiting}
    if plan.run_capacity:  # prompts one short, two tokens each: the KV peaks at exactly seq_len slots
        occupancy: list = []
        prompts = random_prompts(count, plan.capacity_seq_len - 1, vocab, 1, "capacity-run")
        run_engine(engine, prompts, 2, count, occupancy)
        out["max_running_in_full_run"] = max(s.running for s in occupancy)
        out["preemptions_in_full_run"] = engine.scheduler.num_preemptions
    return out


def prefix_caching(plan: Plan, vocab: int, logs: Path) -> dict[str, Any]:
    system = random_prompts(1, plan.system_prompt_len, vocab, 0, "system")[0]
    users = random_prompts(2 * plan.prefix_rounds + 1, 16, vocab, 0, "user")
    ttft: dict[str, list[float]] = {"on": [], "off": []}
    with serve(plan.path, log=logs / "prefix_on.log") as (on_url, _), \
            serve(plan.path, "--no-prefix-caching", log=logs / "prefix_off.log") as (off_url, _):
        urls = {"on": on_url, "off": off_url}
        cold = run_level_sync(on_url, [system + users[-1]], 4, 1)[0].ttft  # fills the cache
        for i in range(plan.prefix_rounds):  # alternate which side goes first
            for side in (("on", "off") if i % 2 == 0 else ("off", "on")):
                timing = run_level_sync(urls[side], [system + users[2 * i + (side == "off")]], 4, 1)[0]
                if timing.error:
                    raise RuntimeError(timing.error)
                ttft[side].append(timing.ttft)
    on, off = statistics.median(ttft["on"]), statistics.median(ttft["off"])
    return {"system_prompt_len": plan.system_prompt_len, "user_len": 16, "cold_ttft_ms": cold * 1000,
            "ttft_on_ms": [t * 1000 for t in ttft["on"]], "ttft_off_ms": [t * 1000 for t in ttft["off"]],
            "median_on_ms": on * 1000, "median_off_ms": off * 1000, "speedup": off / on}


# --- driver ------------------------------------------------------------------------------------------------
def bench_model(name: str, plan: Plan, levels: list[int], parts: set[str]) -> dict[str, Any]:
    from py_engine.config import ModelConfig

    vocab = ModelConfig.from_file(plan.path).vocab_size
    logs = REPO / "benchmarks" / ".cache" / "logs" / Path(name).name  # server logs, kept out of results/
    logs.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"plan": asdict(plan)}
    steps = {"throughput": lambda: throughput(plan, levels, vocab, logs),
             "kv_utilization": lambda: kv_utilization(plan, max(levels), vocab),
             "capacity": lambda: capacity(plan, vocab),
             "prefix_caching": lambda: prefix_caching(plan, vocab, logs)}
    for part, step in steps.items():
        if part in parts:
            start = time.perf_counter()
            print(f"== {name}: {part}", flush=True)
            out[part] = step()
            out[part]["seconds"] = time.perf_counter() - start
            if part != "throughput":
                print(json.dumps(out[part], default=str), flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["builtin", "qwen0.5b"],
                        help="builtin, qwen0.5b, or a model folder")
    parser.add_argument("--levels", default="1,4,16,64", help="concurrency levels (default 1,4,16,64)")
    parser.add_argument("--parts", nargs="+", default=["throughput", "kv_utilization", "capacity",
                                                       "prefix_caching"])
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    report: dict[str, Any] = {"meta": {"machine": platform.machine(), "cpus": os.cpu_count(),
                                       "python": platform.python_version(), "date": time.strftime("%F %T"),
                                       "note": "2 shared vCPUs, noisy: one run per number, no repeats"},
                              "models": {}}
    if args.output.exists():  # keep other models' results when re-running one
        report["models"] = json.loads(args.output.read_text()).get("models", {})
    for name, plan in plans(args.models).items():
        report["models"][name] = {**report["models"].get(name, {}), **bench_model(name, plan, levels,
                                                                                   set(args.parts))}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2, default=str))
    print_summary(report)
    return 0


def print_summary(report: dict[str, Any]) -> None:
    for name, result in report["models"].items():
        print(f"\n## {name}")
        if "throughput" in result:
            print(format_table(result["throughput"]["rows"]))
        for part in ("kv_utilization", "capacity", "prefix_caching"):
            if part in result:
                print(f"{part}: {json.dumps({k: v for k, v in result[part].items() if not isinstance(v, list)})}")


if __name__ == "__main__":
    sys.exit(main())
