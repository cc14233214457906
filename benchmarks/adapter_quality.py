"""Held-out perplexity of the shipped adapters: base, each LoRA expert and X-LoRA, per domain.

    .venv/bin/python benchmarks/adapter_quality.py                 # peft's models and ruvllm's
    .venv/bin/python benchmarks/adapter_quality.py --max-tokens 4000 --only peft
    .venv/bin/python benchmarks/adapter_quality.py --model smollm2-135m-instruct   # first 4096 tokens per domain

The adapters are py_engine/data/adapters/MODEL/ (training/train_adapters.py --base MODEL); the
domains and their held-out works are training/adapter_domains.py (Twelfth Night, Julius Caesar,
Paradise Regained). Every row is scored by py_engine.models.evaluate.perplexity over
non-overlapping windows of 256 tokens (the built-in model's context; the model card's protocol),
`<|endoftext|>` first (as every training document starts):

- peft: transformers' LlamaForCausalLM, peft's PeftModel per LoRA expert and peft's XLoraModel
  (SmolLM2: on its GGUF dequantized to fp32 by `ruvllm import-gguf`, training/adapter_bases.py);
- ruvllm: the same adapters run by ruvllm's engine (LoRA and X-LoRA), which must agree with peft
  (SmolLM2: the `smollm2-135m-instruct` alias loaded with dequantize=True, fp32).

It also reports X-LoRA's mean adapter weights per domain (its softmax over the experts, averaged
over every scored token and every LoRA layer) and checks the acceptance rules: each expert lowest on
its own domain; X-LoRA within 2% of the best expert on every domain and better than the base.
Writes benchmarks/results/adapter_quality.json (SmolLM2: adapter_quality_smollm2-135m-instruct.json).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from common import REPO  # noqa: E402  (also puts the clone's root on sys.path)

from py_engine.models.evaluate import perplexity  # noqa: E402
from training.adapter_bases import BASES, base_folder  # noqa: E402
from training.adapter_domains import DOMAINS, domain_texts  # noqa: E402
from training.train_adapters import peft_loadable  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
WINDOW, STRIDE = 256, 256  # the model card's protocol (training/evaluate.py): non-overlapping windows
DEFAULT_MAX_TOKENS = {"tiny-shakespeare": None, "smollm2-135m-instruct": 4096}  # 135M on 2 cores: a slice


class HFScorer(torch.nn.Module):
    """A transformers / peft model behind the engine's forward(ids, positions, logit_indices=)."""

    def __init__(self, model, vocab_size: int) -> None:
        super().__init__()
        self.inner = model
        self.config = type("Config", (), {"vocab_size": vocab_size})()
        self.scalings: list[torch.Tensor] = []  # X-LoRA: the scalings of each call's scored positions

    def forward(self, ids, positions, kv=None, logit_indices=None):
        logits = self.inner(input_ids=ids).logits
        latest = getattr(self.inner, "get_latest_scalings", lambda: None)()
        if latest is not None:  # [B, T, n_layers, n_experts]
            self.scalings.append(latest[:, logit_indices].mean(dim=2).flatten(0, 1))
        return logits[:, logit_indices]


def peft_models(name: str):
    """(label, scorer) of the base, each expert and X-LoRA, built by transformers and peft."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    folder, adapters = base_folder(name), BASES[name].adapters

    def base():
        model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        model.config.use_cache = False
        return model

    vocab = base().config.vocab_size
    yield "base", HFScorer(base(), vocab)
    for d in DOMAINS:
        yield d.name, HFScorer(PeftModel.from_pretrained(base(), str(adapters / d.name)).eval(), vocab)
    with tempfile.TemporaryDirectory() as tmp:
        loadable = peft_loadable(adapters / "xlora", Path(tmp))
        yield "xlora", HFScorer(PeftModel.from_pretrained(base(), loadable).eval(), vocab)


def engine_folder(name: str) -> tuple[Path, bool]:
    """ruvllm's own folder for the model and whether to dequantize it (a GGUF alias: fp32, as peft's base)."""
    if name == "tiny-shakespeare":
        return base_folder(name), False
    from py_engine.hub import resolve_model

    return resolve_model(name), True


def engine_models(name: str):
    """The same rows run by ruvllm's engine."""
    from py_engine.adapters.xlora import load_xlora
    from py_engine.models import load_model

    folder, dequantize = engine_folder(name)
    base, _ = load_model(str(folder), dtype="float32", dequantize=dequantize)
    yield "base", base
    xlora = record_scalings(load_xlora(load_model(str(folder), dtype="float32", dequantize=dequantize)[0],
                       BASES[name].adapters / "xlora"))
    for i, d in enumerate(DOMAINS):
        yield d.name, xlora.single_expert(i)
    yield "xlora", xlora


def record_scalings(xlora):
    """ruvllm's XLoraModel, keeping the scalings of each call's scored positions as HFScorer does."""
    xlora.scalings = []

    def hook(module, args, kwargs, output):
        index = kwargs.get("logit_indices")
        latest = module.last_scalings  # [B, T, n_layers, n_experts]
        module.scalings.append((latest if index is None else latest[:, index]).mean(dim=2).flatten(0, 1))

    xlora.register_forward_hook(hook, with_kwargs=True)
    return xlora


def score(models, texts: dict[str, list[int]], only_rows: set[str] | None = None) -> dict:
    rows = {}
    for label, model in models:
        if only_rows and label not in only_rows:
            continue
        rows[label] = {}
        for domain, ids in texts.items():
            if hasattr(model, "scalings"):
                model.scalings.clear()
            result = perplexity(model, ids, WINDOW, STRIDE)
            rows[label][domain] = {"perplexity": round(result.perplexity, 4), "tokens": result.tokens,
                                   "seconds": round(result.seconds, 1)}
            scalings = getattr(model, "scalings", None)
            if scalings:  # [tokens, experts] -> the mean weight of each expert
                mean = torch.cat(scalings).mean(dim=0).tolist()
                rows[label][domain]["mean_weights"] = dict(zip((d.name for d in DOMAINS), map(float, mean)))
            print(f"  {label:>10} {domain:>10}: ppl {result.perplexity:8.3f}  ({result.seconds:.1f} s)", flush=True)
    return rows


def check(rows: dict) -> list[str]:
    """The acceptance rules; returns the failures."""
    failures = []
    names = [d.name for d in DOMAINS]
    for domain in names:
        best = min(names, key=lambda n: rows[n][domain]["perplexity"])
        if best != domain:
            failures.append(f"{domain}: the {best} expert beats the {domain} expert")
        best_ppl = rows[best][domain]["perplexity"]
        xl = rows["xlora"][domain]["perplexity"]
        if xl > best_ppl * 1.02:
            failures.append(f"{domain}: X-LoRA {xl:.3f} is more than 2% above the best expert's {best_ppl:.3f}")
        if xl >= rows["base"][domain]["perplexity"]:
            failures.append(f"{domain}: X-LoRA {xl:.3f} is no better than the base")
    return failures


def table(rows: dict) -> str:
    names = [d.name for d in DOMAINS]
    lines = ["| model | " + " | ".join(f"{n} ppl" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, by_domain in rows.items():
        cells = [f"{by_domain[n]['perplexity']:.3f}" for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if any("mean_weights" in v for v in rows.get("xlora", {}).values()):
        lines += ["", "| X-LoRA mean weight on | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for domain in names:
            w = rows["xlora"][domain]["mean_weights"]
            lines.append(f"| {domain} text | " + " | ".join(f"{w[n]:.3f}" for n in names) + " |")
    return "\n".join(lines)


def held_out_ids(name: str, max_tokens: int | None = None) -> dict[str, list[int]]:
    """Each domain's held-out text as ids (ruvllm's tokenizer), `<|endoftext|>` first, cut to max_tokens."""
    from py_engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(str(base_folder(name)))
    separator = BASES[name].separator  # the built-in tokenizer adds it itself
    first = [tok.token_to_id(separator)] if separator else []
    return {d.name: (first + tok.encode(domain_texts(d)[1], add_special_tokens=True))[:max_tokens] for d in DOMAINS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=tuple(BASES), default="tiny-shakespeare", help="the base model")
    p.add_argument("--only", choices=("peft", "ruvllm"), default=None)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="score only this many tokens per domain (default: all; SmolLM2 4096)")
    p.add_argument("--rows", default=None,
                   help="comma-separated rows to score (base,comedies,tragedies,milton,xlora); they replace "
                        "those rows of an existing --out file")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/results/adapter_quality[_MODEL].json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.out is None:
        args.out = RESULTS / ("adapter_quality.json" if args.model == "tiny-shakespeare"
                              else f"adapter_quality_{args.model}.json")
    max_tokens = args.max_tokens or DEFAULT_MAX_TOKENS[args.model]
    texts = held_out_ids(args.model, max_tokens)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": args.model,
              "window": WINDOW, "stride": STRIDE, "max_tokens": max_tokens, "torch": torch.__version__,
              "loadavg": os.getloadavg(), "held_out": {d.name: d.held_out for d in DOMAINS}}
    start = time.perf_counter()
    for engine, models in (("peft", peft_models), ("ruvllm", engine_models)):
        if args.only not in (None, engine):
            continue
        print(f"{engine}:")
        only_rows = set(args.rows.split(",")) if args.rows else None
        if only_rows and args.out.is_file():  # keep the other rows of the earlier run
            earlier = json.loads(args.out.read_text())
            report = {**earlier, **{k: v for k, v in report.items() if k not in earlier or k == "date"}}
            report[engine] = {**earlier.get(engine, {}), **score(models(args.model), texts, only_rows)}
        else:
            report[engine] = score(models(args.model), texts, only_rows)
        report[f"{engine}_failures"] = check(report[engine])
        print(table(report[engine]))
        for failure in report[f"{engine}_failures"]:
            print(f"FAIL {failure}")
    report["seconds"] = round(time.perf_counter() - start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
