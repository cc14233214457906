"""The same load against llama-cpp-python's OpenAI server, on the same weights and precision (GGUF f32).

    python benchmarks/llama_cpp_bench.py --venv DIR [--sdist-dir DIR] [--levels 1,4,16,64]

llama-cpp-python (a pip package that compiles llama.cpp) is installed in a
virtual environment of its own (`--venv`): its server extra pins fastapi,
starlette and pydantic versions ours need not share. The checkpoint is
converted with the converter vendored in its sdist (`--sdist-dir`, the
unpacked llama_cpp_python-X tarball: convert_hf_to_gguf.py and gguf-py): the
random Qwen2.5-0.5B-shape weights of server_bench.py (decode_engines.py's),
float32 as ruvllm runs them, with Qwen2.5's tokenizer from ../shared/fixtures.

Its server takes text prompts, so each prompt is random vocabulary words
re-encoded to the prompt length; `min_tokens` = `max_tokens` stands in for
`ignore_eos`. Note: llama-cpp-python's server runs one completion at a time
behind a lock (no parallel slots, unlike llama.cpp's own llama-server), so
concurrency only queues requests there; `--interrupt_requests False` keeps a
new request from cancelling the one streaming.

llama.cpp's own server (the real anchor: parallel slots, continuous batching):

    python benchmarks/llama_cpp_bench.py --llama-server --quant q4_0 --levels 1,16 --rounds 2 \
        [--gen-length 64] [--baseline DIR]

runs `llama-server -np 16 -c 8192 -t 2` (`make bench-anchors` builds it; --llama-cpp-bin DIR
names another build) and `ruvllm serve`
on the very same GGUF (f32, or q8_0 / q4_0 made by llama-quantize; ruvllm keeps
Q8_0 / Q4_0 codes as they are), alternating the two servers in each round on the
same token-id prompts (`ignore_eos`), and reports output tok/s per level, the
paired ratio ruvllm / llama-server per round, and each server's peak RSS with its
RssAnon / RssFile split at the largest sampled RSS.

KV cache: the same precision and positions as llama-server's. llama-server's default
KV type is f16 (`-ctk f16 -ctv f16`), so `ruvllm serve` gets `--kv-cache-dtype fp16`
and a budget of 8192 fp16 positions (kv_bytes(8192, 2): 96 MiB for Qwen2.5-0.5B, as
llama-server's -c 8192; serve's own default budget is 1 GiB). `--kv-cache-dtypes
fp16,auto` adds a ruvllm server with the model's fp32 KV over 8192 fp32 positions
(`ruvllm@auto`, 192 MiB: the setting before the 16-bit cache), alternating too.
`--baseline DIR` adds `ruvllm serve` run from another source tree (old code vs new, same
environment, alternating too; it gets the fp32 budget and its own default KV dtype).
The issue's workload is prompt 128 + 64 generated (`--gen-length 64`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

from common import REPO, llama_cpp_bin, llama_cpp_sources, machine  # noqa: E402

from native_server.bench.loadgen import run_level_sync  # noqa: E402
from native_server.bench.report import flatten, format_table  # noqa: E402
from native_server.bench.stats import summarize  # noqa: E402
from server_bench import QWEN_TOKENIZER, RESULTS, STARTUP_S, STOP_S, peak_rss_mib  # noqa: E402
from tests.server.server_harness import free_port, http_process  # noqa: E402

GGUF_DIR = REPO / "benchmarks" / ".cache" / "qwen2.5-0.5b-random-seed0-gguf"
VOCAB = 151936  # Qwen2.5's: the token-id prompts of the A/B against llama-server
CONTEXT = 8192  # llama-server's -c; ruvllm serve gets a KV budget of as many positions (kv_bytes)
KV_BYTES_PER_VALUE = {"fp16": 2, "bf16": 2, "auto": 4}  # ruvllm's --kv-cache-dtype on the f32-activation model


def convert(sdist_dir: Path | None = None) -> Path:
    """The f32 GGUF of the Qwen2.5-0.5B-shape checkpoint (made once: decode_engines.f32_gguf)."""
    from decode_engines import f32_gguf

    return f32_gguf()


def text_prompts(count: int, length: int, seed: str) -> tuple[list[str], list[int]]:
    """Prompts of random vocabulary words and their lengths in the Qwen tokenizer (close to `length`)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(QWEN_TOKENIZER / "tokenizer.json"))
    words = sorted(w for w in tok.get_vocab() if w.startswith("\u0120") and w[1:].isascii() and w[1:].isalpha())
    rng = random.Random(seed)
    prompts, lengths = [], []
    for _ in range(count):
        ids = [tok.token_to_id(rng.choice(words)) for _ in range(length)]
        text = tok.decode(ids)
        encoded = tok.encode(text).ids[:length]  # words re-encode to themselves, almost always
        text = tok.decode(encoded)
        prompts.append(text)
        lengths.append(len(tok.encode(text).ids))
    return prompts, lengths


@contextlib.contextmanager
def llama_cpp_server(venv: Path, gguf: Path, n_ctx: int, log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    threads = str(os.cpu_count() or 2)
    command = [str(venv / "bin" / "python"), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", threads, "--n_threads_batch", threads,
               "--interrupt_requests", "False", "--verbose", "False"]
    url = f"http://127.0.0.1:{port}"
    with http_process(command, url, "/v1/models", log, "llama-cpp-python server", startup_s=STARTUP_S,
                      stop_s=STOP_S) as process:
        yield url, process


def throughput(venv: Path, sdist_dir: Path, levels: list[int], prompt_len: int, gen_len: int,
               iterations: int) -> dict[str, Any]:
    gguf = convert(sdist_dir)
    logs = REPO / "benchmarks" / ".cache" / "logs" / "llama_cpp"
    logs.mkdir(parents=True, exist_ok=True)
    extra = {"min_tokens": gen_len}
    rows = []
    with llama_cpp_server(venv, gguf, 4096, logs / "server.log") as (url, process):
        warm, _ = text_prompts(1, prompt_len, "warmup")
        run_level_sync(url, warm, gen_len, 1, extra=extra)
        for level in levels:
            prompts, lengths = text_prompts(level * iterations, prompt_len, f"c{level}")
            timings = run_level_sync(url, prompts, gen_len, level, extra=extra)
            for timing, length in zip(timings, lengths):
                timing.prompt_tokens = length
                if timing.error is None:  # no usage event: min_tokens = max_tokens makes exactly gen_len
                    timing.output_tokens = gen_len
                    if len(timing.chunk_times) == gen_len + 1:  # a last event with finish_reason, no token
                        timing.chunk_times.pop()
            row = {"concurrency": level, "prompt_len": prompt_len, "gen_len": gen_len,
                   **flatten(summarize(timings, level).to_dict())}
            rows.append(row)
            print(format_table([row]), flush=True)
        rss = peak_rss_mib(process.pid)
    for row in rows:
        row["speedup"] = row["output_throughput"] / rows[0]["output_throughput"]
    return {"rows": rows, "server_peak_rss_mib": rss, "gguf": str(gguf), "precision": "f32"}


@contextlib.contextmanager
def llama_server(bin_dir: Path, gguf: Path, threads: int, log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """llama.cpp's llama-server with 16 parallel slots over an 8192-token context, as the issue sets it."""
    port = free_port()
    command = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", "16", "-c", str(CONTEXT), "-t", str(threads), "--no-webui"]
    url = f"http://127.0.0.1:{port}"
    with http_process(command, url, "/health", log, "llama-server", startup_s=STARTUP_S, stop_s=STOP_S) as process:
        yield url, process


def one_server(kind: str, url: str, process: subprocess.Popen, levels: list[int], prompt_len: int,
               gen_len: int, iterations: int) -> dict[str, Any]:
    from decode_engines import RssWatch

    loaded = peak_rss_mib(process.pid)  # VmHWM once it answers: the load's peak (weights, load transients)
    with RssWatch(process, interval=0.05) as watch:  # (the server loaded before: its load peak is in VmHWM only)
        result = _levels(kind, process, url, levels, prompt_len, gen_len, iterations)
    return {**result, "peak_split_mib": watch.split, "loaded_peak_rss_mib": loaded}


def _levels(kind: str, process: subprocess.Popen, url: str, levels: list[int], prompt_len: int, gen_len: int,
            iterations: int) -> dict[str, Any]:
    from native_server.bench.workload import Workload

    workload = Workload(prompt_len, gen_len)
    run_level_sync(url, workload.prompts(2, VOCAB, "warmup"), gen_len, 1)
    rows = []
    for level in levels:
        cpu = process_cpu_s(process.pid)
        timings = run_level_sync(url, workload.prompts(level * iterations, VOCAB, f"c{level}"), gen_len, level)
        result = summarize(timings, level)
        cpu = process_cpu_s(process.pid) - cpu  # the server's CPU time over the level: on a shared machine the
        rows.append({"server": kind, "concurrency": level, **flatten(result.to_dict()), "server_cpu_s": cpu,
                     "output_tok_per_cpu_s": result.output_tokens / cpu if cpu > 0 else None})  # steadier figure
        print(format_table(rows[-1:]) + f"\n  server CPU {cpu:.2f} s, "
              f"{rows[-1]['output_tok_per_cpu_s'] or float('nan'):.2f} output tok per CPU-s", flush=True)
    return {"rows": rows, "peak_rss_mib": peak_rss_mib(process.pid)}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process, all its threads (/proc/PID/stat). llama-server's
    threads spin while they wait, so compare this between ruvllm servers only."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kv_bytes(tokens: int, bytes_per_value: int = 2) -> int:
    """K and V of `tokens` positions in every layer, `bytes_per_value` each (2: fp16, llama-server's default
    -ctk/-ctv f16; 4: fp32): ruvllm's KV budget matching llama-server's -c."""
    from decode_engines import model_config

    c = model_config()
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return tokens * c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * bytes_per_value


def native_ab(bin_dir: Path, quant: str, levels: list[int], rounds: int, threads: int, prompt_len: int,
              gen_len: int, iterations: int, backends: list[str] | None = None, llama: bool = True,
              ruvllm_flags: list[str] | None = None, baseline: Path | None = None,
              kv_dtypes: list[str] | None = None, logs: Path | None = None) -> dict[str, Any]:
    """ruvllm serve (once per attention backend: `ruvllm:BACKEND`, or `ruvllm` for the default, and per KV
    dtype after the first of kv_dtypes: `ruvllm@auto`), the same served from another checkout
    (`ruvllm-baseline`: old code vs new, paired) and llama-server on one GGUF, alternating (the order rotates
    each round), `rounds` times."""
    from decode_engines import gguf_file
    from server_bench import serve

    gguf = gguf_file(quant)
    logs = logs or REPO / "benchmarks" / ".cache" / "logs" / "llama_server"
    logs.mkdir(parents=True, exist_ok=True)
    kv_dtypes = kv_dtypes or ["fp16"]
    kinds = [f"ruvllm:{b}" for b in backends] if backends else ["ruvllm"]
    kinds += [f"{k}@{kv}" for kv in kv_dtypes[1:] for k in kinds]
    kinds += ["ruvllm-baseline"] if baseline is not None else []
    kinds += ["llama-server"] if llama else []
    runs = []
    for rnd in range(rounds):
        order = kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]
        for kind in order:
            print(f"== round {rnd}: {kind} on {gguf.name}", flush=True)
            if kind.startswith("ruvllm"):
                name, _, kv = kind.partition("@")
                kv = kv or ("auto" if kind == "ruvllm-baseline" else kv_dtypes[0])
                backend = ["--attention-backend", name.split(":")[1]] if ":" in name else []
                kv_flags = ["--kv-cache-dtype", kv] if kv != "auto" else []  # (a baseline may predate the flag's fp16)
                server = serve(str(gguf), "--max-concurrent", str(max(levels)), "--kv-cache-memory",
                               str(kv_bytes(CONTEXT, KV_BYTES_PER_VALUE[kv])), "--max-context", str(CONTEXT),
                               *kv_flags, *backend, *(ruvllm_flags or []),
                               log=logs / f"{kind.replace(':', '-').replace('@', '-')}.log",
                               checkout=baseline if kind == "ruvllm-baseline" else None)
            else:
                server = llama_server(bin_dir, gguf, threads, logs / "llama-server.log")
            with server as (url, process):
                runs.append({"round": rnd, "server": kind,
                             **one_server(kind, url, process, levels, prompt_len, gen_len, iterations)})
    # each pair of servers, A / B, per round; the median over rounds
    pairs = [(a, b) for i, a in enumerate(kinds) for b in kinds[i + 1:]]
    ratios: dict[str, dict[str, float]] = {}
    cpu_ratios: dict[str, dict[str, float]] = {}  # output tokens per server CPU-second, ruvllm kinds only
    for level in levels:
        for a, b in pairs:
            per_round, per_cpu = [], []
            for rnd in range(rounds):
                row = {r["server"]: next(x for x in r["rows"] if x["concurrency"] == level)
                       for r in runs if r["round"] == rnd}
                per_round.append(row[a]["output_throughput"] / row[b]["output_throughput"])
                if "llama-server" not in (a, b) and row[a]["output_tok_per_cpu_s"] and row[b]["output_tok_per_cpu_s"]:
                    per_cpu.append(row[a]["output_tok_per_cpu_s"] / row[b]["output_tok_per_cpu_s"])
            ratios.setdefault(f"{a} / {b}", {})[f"c{level}"] = statistics.median(per_round)
            if per_cpu:
                cpu_ratios.setdefault(f"{a} / {b}", {})[f"c{level}"] = statistics.median(per_cpu)
    rss = {kind: max(r["peak_rss_mib"] for r in runs if r["server"] == kind) for kind in kinds}
    split = {kind: max((r["peak_split_mib"] for r in runs if r["server"] == kind), key=lambda x: x.get("rss", 0))
             for kind in kinds}  # RssAnon / RssFile at the largest sampled RSS, of the round with the largest
    if kinds == ["ruvllm", "llama-server"]:  # the report's earlier shape
        ratios = ratios["ruvllm / llama-server"]
    return {"gguf": str(gguf), "quant": quant, "threads": threads, "ruvllm_flags": ruvllm_flags or [],
            "baseline": str(baseline) if baseline is not None else None, "gen_length": gen_len, "runs": runs,
            "kv_cache": {"ruvllm": f"--kv-cache-dtype {kv_dtypes[0]}, --kv-cache-memory "
                                   f"{kv_bytes(CONTEXT, KV_BYTES_PER_VALUE[kv_dtypes[0]])} = {CONTEXT} positions "
                                   "(fp16: llama-server's default f16 KV precision, and its -c)",
                         "kv_dtypes": kv_dtypes, "llama-server": f"-c {CONTEXT}, f16 K and V (its default)"},
            "paired_ratio": ratios, "paired_ratio_per_cpu_s": cpu_ratios, "peak_rss_mib": rss,
            "peak_split_mib": split}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, help="virtual environment with llama-cpp-python[server]")
    parser.add_argument("--sdist-dir", type=Path, help="the unpacked llama_cpp_python sdist (its converter)")
    parser.add_argument("--llama-server", action="store_true", help="llama.cpp's own llama-server vs ruvllm, A/B "
                        "(the build of `make bench-anchors`)")
    parser.add_argument("--llama-cpp-bin", type=Path, help="with --llama-server: another build's bin folder")
    parser.add_argument("--quant", default="f32", choices=["f32", "q8_0", "q4_0"], help="with --llama-cpp-bin")
    parser.add_argument("--rounds", type=int, default=2, help="A/B rounds with --llama-cpp-bin")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    parser.add_argument("--levels", default="1,4,16,64")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--gen-length", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--ruvllm-backends", help="with --llama-cpp-bin: one ruvllm server per paged attention "
                        "backend, e.g. torch,cpu (before/after the C decode attention); default: serve's own")
    parser.add_argument("--no-llama-server", action="store_true", help="with --llama-cpp-bin: ruvllm servers only")
    parser.add_argument("--baseline", type=Path, help="with --llama-cpp-bin: also serve from this ruvllm source tree "
                        "(e.g. `git archive main | tar -x -C DIR`), alternating: old code vs new, paired")
    parser.add_argument("--ruvllm-flags", default="", help="more `ruvllm serve` flags, e.g. '--kv-hot-tokens 64'")
    parser.add_argument("--kv-cache-dtypes", default="fp16", help="ruvllm's --kv-cache-dtype, the first for `ruvllm` "
                        "(default fp16: llama-server's f16 KV), each other a server of its own (`ruvllm@auto`: fp32 "
                        "KV), each with a budget of 8192 positions of its bytes")
    parser.add_argument("--log-dir", type=Path, help="the servers' logs (default benchmarks/.cache/logs/llama_server)")
    parser.add_argument("--out", type=Path, help="the JSON report (default results/llama_server_QUANT.json)")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    if not set(args.kv_cache_dtypes.split(",")) <= set(KV_BYTES_PER_VALUE):
        parser.error(f"--kv-cache-dtypes: each one of {', '.join(KV_BYTES_PER_VALUE)}")
    if args.llama_server or args.llama_cpp_bin is not None:
        backends = args.ruvllm_backends.split(",") if args.ruvllm_backends else None
        result = native_ab(llama_cpp_bin(args.llama_cpp_bin), args.quant, levels, args.rounds, args.threads, args.prompt_length,
                           args.gen_length, args.iterations, backends, not args.no_llama_server,
                           args.ruvllm_flags.split(), args.baseline, args.kv_cache_dtypes.split(","),
                           args.log_dir)

        result["machine"] = machine()
        out = args.out or RESULTS.parent / f"llama_server_{args.quant}.json"
        out.write_text(json.dumps(result, indent=2, default=str))
        for run in result["runs"]:
            print(format_table(run["rows"]))
        print(f"output tok/s ratios (paired, median over rounds): {result['paired_ratio']}; per server CPU-s: "
              f"{result['paired_ratio_per_cpu_s']}; "
              f"peak RSS MiB {result['peak_rss_mib']}; anon / file at the largest sampled RSS "
              f"{result['peak_split_mib']}; wrote {out}")
        return 0
    if args.venv is None:
        parser.error("--venv (llama-cpp-python's server), or --llama-server (llama.cpp's own)")
    result = throughput(args.venv, args.sdist_dir or llama_cpp_sources(), levels, args.prompt_length, args.gen_length, args.iterations)
    report = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"models": {}}
    report.setdefault("models", {}).setdefault("qwen0.5b", {})["llama_cpp_python"] = result
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2, default=str))
    print(format_table(result["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
