"""`ruvllm benchmark MODEL`: prefill latency, decode tok/s, TTFT / ITL percentiles, throughput, peak memory.

Without `--url` the engine runs in this process (`offline.py`): the
single-stream row gives prefill latency (time to the first token of a
--prompt-length prompt) and decode tok/s (1 / time per output token); each
--concurrency level N keeps N requests in the engine at once and adds
aggregate output tok/s, KV block utilization and peak RSS. With `--url` it
drives a running OpenAI-compatible server over streaming HTTP at each level
(default 1,4,16,64), as vLLM's benchmark_serving does.

Every level runs --iterations x N requests after --warmup requests: in
process as waves of N added at once, against a server as a closed loop that
keeps N in flight. Each level and wave draws fresh random-token prompts
(workload.py), so the prefix cache never serves one run from another's blocks.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any, Sequence

from native_server.bench.report import FORMATS, flatten, render
from native_server.bench.stats import RequestTiming, RunResult, summarize
from native_server.bench.workload import Workload
from py_engine.adapters.config import add_lora_options, lora_from_args
from native_server.engine.config import EngineConfig
from py_engine.quant.config import quant_config_from_args

SERVER_LEVELS = (1, 4, 16, 64)


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r} (e.g. 1,4,16,64)") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {text!r}")
    return levels


def _count(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def add_benchmark_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `benchmark` on the `ruvllm` command's subparsers."""
    from py_engine.hub import BUILTIN_MODEL

    p = subparsers.add_parser("benchmark", help="measure latency and throughput, in-process or of a server",
                              description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("model", nargs="?", default=BUILTIN_MODEL, metavar="MODEL",
                   help=f"local dir, alias, cached repo id (default {BUILTIN_MODEL}); with --url, where the "
                        "vocabulary size is read from")
    p.add_argument("--url", metavar="URL", help="benchmark the server at URL (http://127.0.0.1:8000) instead")
    p.add_argument("--warmup", type=_count(0), default=1, metavar="N", help="requests before measuring (default 1)")
    p.add_argument("--iterations", type=_count(1), default=2, metavar="N",
                   help="waves of CONCURRENCY requests measured per level (default 2)")
    p.add_argument("--prompt-length", type=_count(1), default=128, metavar="N", help="prompt tokens (default 128)")
    p.add_argument("--gen-length", type=_count(1), default=64, metavar="N",
                   help="tokens generated per request, EOS ignored (default 64)")
    p.add_argument("--concurrency", type=_levels, metavar="N[,N...]",
                   help="requests in flight, one level or a list (default: 1; with --url 1,4,16,64)")
    p.add_argument("--format", choices=FORMATS, default="table", help="output format (default table)")
    p.add_argument("--output", metavar="FILE", help="also write the report to FILE")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument("--vocab-size", type=_count(4), metavar="N",
                   help="prompt ids are drawn below N (default: MODEL's config.json vocab_size)")
    EngineConfig.add_cli_args(p, lora=False)  # the in-process engine's (without --url): serve's own flags
    p.set_defaults(max_concurrent=None)  # the batch holds the largest --concurrency level unless asked for more
    add_lora_options(p)  # --lora NAME=PATH loads adapters in process; --adapter NAME (with --url too) runs one
    p.set_defaults(func=run_benchmark)
    return p


def _row(result: RunResult, workload: Workload, single: RunResult | None) -> dict[str, Any]:
    row = {"concurrency": result.concurrency, "prompt_len": workload.prompt_len, "gen_len": workload.gen_len,
           **flatten(result.to_dict())}
    if single is not None and single.output_throughput > 0:
        row["speedup"] = result.output_throughput / single.output_throughput
    return row


def _waves(workload: Workload, concurrency: int, iterations: int, vocab: int, label: str) -> list[list[int]]:
    return workload.prompts(concurrency * iterations, vocab, f"{label}/c{concurrency}")


def run_offline(args: argparse.Namespace, workload: Workload, levels: Sequence[int]) -> tuple[list[dict], dict]:
    from native_server.bench.offline import occupancy_at_peak, peak_rss_mib, run_engine
    from native_server.engine.llm_engine import LLMEngine
    from py_engine.hub import resolve_model

    path = resolve_model(args.model, args.cache_dir)
    loras, adapter = lora_from_args(args)
    seqs = max(max(levels), args.max_concurrent or 1)  # the largest level at once; --max-concurrent may add room
    engine = LLMEngine(EngineConfig.from_cli_args(args, model=str(path), served_model_name=args.model,
                                                  max_num_seqs=seqs, lora_modules=loras))
    vocab = args.vocab_size or engine.model_config.vocab_size
    if args.warmup:
        run_engine(engine, workload.prompts(args.warmup, vocab, "warmup"), workload.gen_len, 1, lora=adapter)
    rows, single = [], None
    for level in levels:
        occupancy: list = []
        timings: list[RequestTiming] = []
        duration = 0.0
        for wave in range(args.iterations):  # a wave: `level` requests added at once, run to the end
            prompts = workload.prompts(level, vocab, f"offline/c{level}/i{wave}")
            wave_timings = run_engine(engine, prompts, workload.gen_len, level, occupancy, lora=adapter)
            duration += summarize(wave_timings, level).duration_s
            timings += wave_timings
        result = summarize(timings, level, duration)
        single = single or (result if level == 1 else None)
        row = _row(result, workload, single)
        if level == 1:
            row["prefill_ms"] = result.ttft_ms.p50  # the first step computes the whole prompt and samples
            row["prefill_tok_s"] = workload.prompt_len / (result.ttft_ms.p50 / 1000)
            row["decode_tok_s"] = 1000 / result.tpot_ms.mean
        peak = occupancy_at_peak(occupancy)
        if peak is not None:
            row.update(kv_utilization=peak.utilization, kv_peak_running=peak.running)
        row["peak_rss_mib"] = peak_rss_mib()
        rows.append(row)
    config, kv = engine.model_config, engine.kv
    meta = {"mode": "offline", "model": args.model, "path": str(path), "device": str(engine.device),
            "dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch."),
            "kv_blocks": kv.num_blocks, "block_size": kv.block_size, "max_model_len": engine.max_model_len,
            "parameters": config.num_parameters(), "torch_threads": _torch_threads(),
            "quantization": quant_config_from_args(args).describe(), "adapter": adapter,
            "kv_cache_dtype": args.kv_cache_dtype, "kv_hot_tokens": args.kv_hot_tokens,
            "kv_cold_blocks": kv.num_cold_blocks, "kv_capacity_tokens": (kv.num_blocks + kv.num_cold_blocks) * kv.block_size}
    return rows, meta


def run_server(args: argparse.Namespace, workload: Workload, levels: Sequence[int]) -> tuple[list[dict], dict]:
    from native_server.bench.loadgen import run_level_sync, served_model

    url = args.url.rstrip("/")
    model = args.adapter or served_model(url)  # --adapter: a LoRA adapter the server serves
    vocab = args.vocab_size or _vocab_size(args)
    if args.warmup:
        run_level_sync(url, workload.prompts(args.warmup, vocab, "warmup"), workload.gen_len, 1, model)
    rows, single = [], None
    for level in levels:
        timings = run_level_sync(url, _waves(workload, level, args.iterations, vocab, "server"),
                                 workload.gen_len, level, model)
        result = summarize(timings, level)
        single = single or (result if level == 1 else None)
        rows.append(_row(result, workload, single))
    return rows, {"mode": "server", "url": url, "model": model}


def _vocab_size(args: argparse.Namespace) -> int:
    from py_engine.config import ModelConfig
    from py_engine.hub import resolve_model

    return ModelConfig.from_file(resolve_model(args.model, args.cache_dir)).vocab_size


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def run_benchmark(args: argparse.Namespace) -> int:
    quant = quant_config_from_args(args)
    if args.url and args.lora:
        raise ValueError("--lora loads adapters into the in-process engine; with --url pick one the server "
                         "serves with --adapter NAME")
    if args.url and quant.enabled:
        raise ValueError("--quantization applies to the in-process engine; with --url the server runs what "
                         "`ruvllm serve --quantization ...` loaded")
    workload = Workload(args.prompt_length, args.gen_length, args.seed)
    levels = args.concurrency or (SERVER_LEVELS if args.url else (1,))
    rows, meta = (run_server if args.url else run_offline)(args, workload, levels)
    meta.update(prompt_len=workload.prompt_len, gen_len=workload.gen_len, iterations=args.iterations,
                warmup=args.warmup, seed=args.seed, cpu_count=os.cpu_count(), machine=platform.machine(),
                python=platform.python_version())
    text = render(rows, args.format, meta)
    if args.format == "table":
        text = f"{meta['mode']} benchmark of {meta['model']}: {json.dumps(_short(meta))}\n{text}"
    print(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    sys.stdout.flush()
    return 0


def _short(meta: dict[str, Any]) -> dict[str, Any]:
    keep = ("device", "dtype", "quantization", "kv_blocks", "block_size", "torch_threads", "url", "prompt_len",
            "gen_len")
    return {k: meta[k] for k in keep if k in meta}
