"""Structured outputs: grammar compile time and per-token mask overhead, in CPython and Pyodide,
at vocabularies of 4k (the built-in model), ~50k (SmolLM2's if ../shared has it, else GPT-2's)
and 152k (Qwen2.5), with lm-format-enforcer (pure Python, the peer) where it is installed.

Per vocabulary and grammar (a JSON schema with strings, an e-mail and a counted string; a nested
order with a uuid, a pattern and anyOf; a phone-number regex), replaying a valid document's
tokens through the Guide (benchmarks/guided_measure.py, stdlib only, the same code in Pyodide):
  index      the vocabulary trie, built once per tokenizer
  compile    schema/regex -> minimal DFA
  first      per token on the first generation (masks computed as states are reached)
  warm       per token once they are cached: the overhead after compilation (goal < 1 ms)
  all masks  every state's mask precomputed; torch  MaskTensors + masked_fill of a [V] row (server)
  lmfe       lm-format-enforcer's get_allowed_tokens per token, same document, first pass (its
             tokenizer data build is not counted; built as its transformers integration would,
             which does not import under transformers 5)

Run: flock /tmp/ruvllm-bench.lock .venv/bin/python benchmarks/guided_bench.py [--no-pyodide] [--no-lmfe]
Writes benchmarks/results/guided_bench.json (with CPU flags and load) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO  # noqa: E402  (also puts the clone's root on sys.path)
FIXTURES = Path(os.environ.get("RUVLLM_SHARED_FIXTURES", REPO.parent / "shared" / "fixtures")) / "tokenizers"
RESULTS = REPO / "benchmarks" / "results" / "guided_bench.json"

from common import machine  # noqa: E402  (CPU model, ISA flags, load average, commit)
from guided_measure import CASES, _spec, document_text, measure  # noqa: E402


def vocabularies() -> dict[str, Path]:
    found = {"builtin-4k": REPO / "py_engine" / "data" / "tiny-shakespeare"}
    mid = next((FIXTURES / n for n in ("smollm2", "smollm2-135m", "gpt2") if (FIXTURES / n / "tokenizer.json").exists()),
               None)
    if mid is not None:
        found[f"{mid.name}-50k"] = mid
    if (FIXTURES / "qwen2.5" / "tokenizer.json").exists():
        found["qwen2.5-152k"] = FIXTURES / "qwen2.5"
    return found


def torch_path(folder: Path) -> dict[str, float]:
    """Per token, warm: the server's step-0 cost (a cached [V] bool mask, masked_fill of a float32 row)."""
    import torch

    from native_server.engine.sampler import MaskTensors
    from py_engine.guided import Guide, token_grammar
    from py_engine.tokenizer import Tokenizer

    torch.set_num_threads(1)
    tok = Tokenizer.from_pretrained(folder)
    out = {}
    for name, case in CASES.items():
        grammar = token_grammar(_spec(case), tok, [tok.eos_token_id] if tok.eos_token_id is not None else [])
        ids = tok.encode(document_text(case), add_special_tokens=False)
        tensors = MaskTensors(grammar.vocab_size, torch.device("cpu"))
        row = torch.randn(grammar.vocab_size)
        best = float("inf")
        for _ in range(4):
            guide = Guide(grammar)
            started = time.perf_counter()
            for token in ids:
                row.masked_fill(~tensors.get(guide.mask()), -torch.inf)
                guide.advance(token)
            best = min(best, (time.perf_counter() - started) / len(ids))
        out[name] = best
    return out


def lmfe(folder: Path) -> dict:
    """lm-format-enforcer on the same documents (an error note when it is not installed).

    Its transformers integration does not import under transformers 5, so its tokenizer data is
    built here the way that integration builds it (each token decoded after a "0" token, HF
    `tokenizers` decoding), then given to its TokenEnforcer unchanged."""
    try:
        import tokenizers
        from lmformatenforcer import JsonSchemaParser, RegexParser, TokenEnforcer
        from lmformatenforcer.tokenenforcer import TokenEnforcerTokenizerData
    except ImportError as exc:
        return {"error": f"not installed: {exc}"}
    from py_engine.tokenizer import Tokenizer

    hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    ours = Tokenizer.from_pretrained(folder)
    started = time.perf_counter()
    zero = hf.encode("0", add_special_tokens=False).ids[-1]
    regular = []
    for i in range(hf.get_vocab_size()):
        if ours.is_special(i):
            continue
        after_zero = hf.decode([zero, i], skip_special_tokens=False)[1:]
        regular.append((i, after_zero, len(after_zero) > len(hf.decode([i], skip_special_tokens=False))))
    data = TokenEnforcerTokenizerData(regular, lambda ids: hf.decode(ids).rstrip("\ufffd"),
                                      ours.eos_token_id, False, hf.get_vocab_size())
    out = {"tokenizer_data_s": time.perf_counter() - started, "cases": {}}
    for name, case in CASES.items():
        parser = JsonSchemaParser(case["schema"]) if "schema" in case else RegexParser(case["regex"])
        ids = ours.encode(document_text(case), add_special_tokens=False)
        enforcer = TokenEnforcer(data, parser)
        started = time.perf_counter()
        for i in range(len(ids)):
            enforcer.get_allowed_tokens(ids[:i])
        out["cases"][name] = (time.perf_counter() - started) / len(ids)
    return out


def pyodide(vocabs: dict[str, Path]) -> dict:
    if not shutil.which("node") or not (REPO / "npm" / "node_modules" / "pyodide").is_dir():
        return {"error": "node or npm/node_modules/pyodide is missing"}
    from web.wheels import build_wheels

    build_wheels(REPO / "npm" / "wheels")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pyodide.json"
        run = subprocess.run(["node", str(REPO / "benchmarks" / "guided_pyodide.mjs"), str(out),
                              *map(str, vocabs.values())], capture_output=True, text=True, timeout=7200)
        if run.returncode != 0:
            return {"error": run.stderr[-2000:]}
        by_dir = json.loads(out.read_text())
    return {name: by_dir[str(folder)] for name, folder in vocabs.items()}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}" if seconds < 0.01 else f"{seconds * 1e3:.1f}"


def table(results: dict) -> str:
    head = ("vocab", "runtime", "case", "states", "index ms", "compile ms", "first ms/tok", "warm ms/tok",
            "all masks ms", "mask mean ms", "apply row ms", "torch ms/tok", "lmfe ms/tok")
    rows = [head]
    for vocab, by_runtime in results["vocabularies"].items():
        for runtime in ("cpython", "pyodide"):
            m = by_runtime.get(runtime)
            if not isinstance(m, dict) or "cases" not in m:
                continue
            for case, c in m["cases"].items():
                lm = by_runtime.get("lmfe", {}).get("cases", {}).get(case) if runtime == "cpython" else None
                torch_ms = by_runtime.get("torch", {}).get(case) if runtime == "cpython" else None
                rows.append((vocab, runtime, case, str(c["states"]), _ms(m["index_s"]), _ms(c["compile_s"]),
                             _ms(c["first_pass_per_token_s"]), _ms(c["warm_per_token_s"]), _ms(c["all_masks_s"]),
                             _ms(c["mask_mean_s"]), _ms(c["apply_row_s"]), _ms(torch_ms), _ms(lm)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-pyodide", action="store_true")
    parser.add_argument("--no-lmfe", action="store_true")
    parser.add_argument("--only-lmfe", action="store_true", help="rerun lm-format-enforcer into the existing JSON")
    args = parser.parse_args()
    vocabs = vocabularies()
    if args.only_lmfe:
        results = json.loads(RESULTS.read_text())
        for name, folder in vocabs.items():
            print(f"lm-format-enforcer: {name}", file=sys.stderr, flush=True)
            results["vocabularies"][name]["lmfe"] = lmfe(folder)
        results["machine"]["lmfe_loadavg"] = os.getloadavg()
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        print(table(results))
        return 0
    results = {"machine": machine(), "vocabularies": {name: {} for name in vocabs}}
    for name, folder in vocabs.items():
        print(f"cpython: {name}", file=sys.stderr, flush=True)
        results["vocabularies"][name]["cpython"] = measure(str(folder))
        results["vocabularies"][name]["torch"] = torch_path(folder)
        if not args.no_lmfe:
            print(f"lm-format-enforcer: {name}", file=sys.stderr, flush=True)
            results["vocabularies"][name]["lmfe"] = lmfe(folder)
    if not args.no_pyodide:
        print("pyodide (node)", file=sys.stderr, flush=True)
        found = pyodide(vocabs)
        if "error" in found:
            print(f"pyodide failed: {found['error']}", file=sys.stderr)
            results["pyodide_error"] = found["error"]
        for name, m in found.items():
            if name in results["vocabularies"]:
                results["vocabularies"][name]["pyodide"] = m
    results["machine"]["loadavg_end"] = os.getloadavg()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    print(f"\nload average {results['machine']['loadavg_start']} -> {results['machine']['loadavg_end']}; "
          f"wrote {RESULTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
