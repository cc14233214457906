"""Multi-LoRA serving speed: output tok/s of `ruvllm serve` with four adapters mixed in one batch, against the base.

    python benchmarks/lora_server_bench.py [--model tiny-shakespeare] [--concurrency 16] [--rounds 3]

Two servers run at once on 127.0.0.1 (float32, the same flags): a plain one, and one started with
`--lora-modules` (the four peft adapters of tests/server/lora_adapters.py, ranks 2-16, built on the model
once). Rounds alternate, each measuring, at the given concurrency over streaming HTTP:
  base       the plain server, every request the base model         (the reference)
  mixed      the LoRA server, requests cycling over the 4 adapters  (the issue's goal: >= 0.8x base)
  one        the LoRA server, every request the same adapter
  lora-base  the LoRA server, every request the base model          (the wrappers' cost when idle)
The machine is shared and noisy: the ratios of medians over rounds are the figures to read. Writes
benchmarks/results/lora_server_bench.json (with the CPU flags) and prints a table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from common import REPO  # noqa: E402  (also puts the clone's root on sys.path)

from native_server.bench.loadgen import run_level_sync  # noqa: E402
from native_server.bench.report import format_table  # noqa: E402
from native_server.bench.stats import summarize  # noqa: E402
from native_server.bench.workload import Workload  # noqa: E402
from server_bench import serve  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "lora_server_bench.json"
ADAPTER_DIR = REPO / "benchmarks" / ".cache" / "lora-adapters"
RUNS = ("base", "mixed", "one", "lora-base")


def adapters(model: str) -> dict[str, Path]:
    """The four test adapters, trained-shape but random, on the model (a GGUF's float import for peft)."""
    from tests.server.lora_adapters import ADAPTERS, build_adapters

    folder = ADAPTER_DIR / model
    if not all((folder / name / "adapter_config.json").is_file() for name in ADAPTERS):
        folder.mkdir(parents=True, exist_ok=True)
        return build_adapters(folder, base=float_folder(model))
    return {name: folder / name for name in ADAPTERS}


def float_folder(model: str) -> Path:
    """A Hugging Face folder transformers (and so peft) loads: the model's own, or a GGUF's float import."""
    from py_engine.hub import resolve_model
    from py_engine.importers.gguf.folder import read_source

    path = resolve_model(model)
    source = read_source(path)
    if source is None:
        return path
    from py_engine.importers.gguf.convert import import_gguf

    out = ADAPTER_DIR / f"{model}-float"
    if not (out / "model.safetensors").is_file():
        import_gguf(source, out)
    return out


@contextlib.contextmanager
def servers(model: str, loras: dict[str, Path], concurrency: int, log_dir: Path) -> Iterator[tuple[str, str]]:
    flags = ["--max-concurrent", str(concurrency), "--served-model-name", "base", "--no-prefix-caching"]
    modules = [f"{name}={path}" for name, path in loras.items()]
    with serve(model, *flags, log=log_dir / "plain.log") as (plain, _), \
            serve(model, *flags, "--lora-modules", *modules, log=log_dir / "lora.log") as (lora, _):
        yield plain, lora


def measure(url: str, models: list[str], workload: Workload, concurrency: int, label: str) -> dict:
    prompts = workload.prompts(concurrency * 2, 256, label)  # two waves' worth, every request in flight at once
    result = summarize(run_level_sync(url, prompts, workload.gen_len, concurrency, models), concurrency)
    return {"out_tok_s": result.output_throughput, "tpot_ms": result.tpot_ms.mean, "ttft_ms_p50": result.ttft_ms.p50,
            "errors": result.num_errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-shakespeare")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--gen-length", type=int, default=64)
    args = parser.parse_args()
    from common import machine

    loras = adapters(args.model)
    names = list(loras)
    workload = Workload(args.prompt_length, args.gen_length, seed=0)
    plan = {"base": ("plain", ["base"]), "mixed": ("lora", names), "one": ("lora", names[:1]),
            "lora-base": ("lora", ["base"])}
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **machine(), "model": args.model,
            "concurrency": args.concurrency, "prompt_len": args.prompt_length, "gen_len": args.gen_length,
            "adapters": {n: str(p.relative_to(REPO)) for n, p in loras.items()}, "note": "shared 2-core machine"}
    rounds: list[dict[str, dict]] = []
    log_dir = ADAPTER_DIR.parent
    with servers(args.model, loras, args.concurrency, log_dir) as (plain, lora):
        urls = {"plain": plain, "lora": lora}
        for server, models in plan.values():  # warm-up: first requests build kernel plans
            run_level_sync(urls[server], workload.prompts(2, 256, "warmup"), 4, 2, models)
        for r in range(args.rounds):
            order = RUNS if r % 2 == 0 else tuple(reversed(RUNS))  # alternate A/B order
            rounds.append({run: measure(urls[plan[run][0]], plan[run][1], workload, args.concurrency,
                                        f"{run}/r{r}") for run in order})
            print(f"round {r}: " + ", ".join(f"{k} {v['out_tok_s']:.1f}" for k, v in rounds[-1].items()), flush=True)
    rows = table(rounds)
    print(format_table(rows, [(k, k) for k in rows[0]]))
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows, "rounds": rounds}, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")


def table(rounds: list[dict[str, dict]]) -> list[dict]:
    """Per run: median tok/s, and the median over rounds of its ratio to that round's base (a paired A/B)."""
    def med(run: str, key: str) -> float:
        return statistics.median(rd[run][key] for rd in rounds)

    return [{"run": run, "out tok/s (median)": round(med(run, "out_tok_s"), 1),
             "x base (median of rounds)": round(statistics.median(rd[run]["out_tok_s"] / rd["base"]["out_tok_s"]
                                                                  for rd in rounds), 3),
             "x base (range)": "%.2f-%.2f" % (min(r := [rd[run]["out_tok_s"] / rd["base"]["out_tok_s"]
                                                          for rd in rounds]), max(r)),
             "TPOT ms": round(med(run, "tpot_ms"), 1), "errors": sum(rd[run]["errors"] for rd in rounds)}
            for run in RUNS]


if __name__ == "__main__":
    main()
