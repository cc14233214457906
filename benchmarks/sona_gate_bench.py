"""Retrieval-gated learning, measured: one correction, its question asked either way, and nothing else.

    python benchmarks/sona_gate_bench.py --model smollm2-135m-instruct      # ~30-60 min on 2 loaded cores
    python benchmarks/sona_gate_bench.py --facts 10 --ablation-facts 5 --no-consolidate   # a quick look

Task (sona_task.py): invented facts, each a question and a held-out paraphrase.
For each fact, a fresh session gets ONE correction of its question (Sona.learn,
what the server's instant thread runs), then greedy chat answers (Sona.chat: the
gate, the pattern as context, its MicroLoRA) to:
- the question and its paraphrase (never trained on): accuracy = the answer word
  in the reply's first line;
- `--others` other facts' questions in the same session, and the same question in
  another session: "changed" = the reply differs from the base's greedy reply;
- every other fact's question and paraphrase through the gate only (no
  generation): how often a wrong pattern is found ("gate false hits").
Instant update latency = Sona.learn (embed, train the pattern's MicroLoRA, store)
+ pattern_adapter (the fold the server publishes): correction received -> the next
request can use it.
Variants (the ablations): the gate with MiniLM and the pattern's MicroLoRA (the
default); MicroLoRA + the pattern as context; context only; the model's own hidden
states as the embedding; no gate (the session's pattern on every request of the
session: threshold -1, no keywords).
Consolidation (default variant): the taught patterns consolidated into one LoRA;
then a fresh session's accuracy, `--controls` untaught facts' answers (must stay
the base's) and validation perplexity with the consolidated adapter on every token
(an upper bound: with the gate, a request nothing matches runs the base).
Writes benchmarks/results/sona_gate_bench_<model>.json, prints tables, draws an SVG
(and a PNG of it with playwright's Chromium when available).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from common import REPO, machine  # noqa: E402  (benchmarks/common.py: also puts the clone on sys.path)
from sona_gate_plot import draw, to_png  # noqa: E402
from sona_task import Fact, facts  # noqa: E402

VARIANTS = {  # name -> (label, SonaConfig fields over the default)
    "gate": ("gate: MicroLoRA (MiniLM)", {}),
    "gate-both": ("gate: MicroLoRA + context", {"apply": "both"}),
    "gate-context": ("gate: context only", {"apply": "context"}),
    "gate-hidden": ("gate: hidden-state embedding", {"embedder": "model"}),
    "no-gate": ("no gate (the session's pattern on every request)", {"gate_threshold": -1.0, "gate_keywords": False}),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-shakespeare")
    p.add_argument("--facts", type=int, default=50, help="facts taught with the default variant")
    p.add_argument("--ablation-facts", type=int, default=10, help="facts taught with each other variant")
    p.add_argument("--controls", type=int, default=10, help="untaught facts checked after consolidation")
    p.add_argument("--others", type=int, default=2, help="other questions asked in each fact's session")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names (default: all)")
    p.add_argument("--no-consolidate", action="store_true")
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1, help="torch threads (2 oversubscribe a shared 2-core machine)")
    p.add_argument("--config", default="{}", help="JSON of SonaConfig fields for every variant")
    p.add_argument("--out", type=Path)
    return p.parse_args()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


class Run:
    """One variant's Sona and the task's questions."""

    def __init__(self, args: argparse.Namespace, overrides: dict, embedder=None) -> None:
        from py_engine.learning import Sona, SonaConfig

        self.args = args
        fields = {"consolidate_every": 0, "seed": args.seed, **json.loads(args.config), **overrides}
        self.sona = Sona.load(args.model, SonaConfig(**fields),
                              embedder=embedder if fields.get("embedder", "minilm") == "minilm" else None)
        self.facts: list[Fact] = facts(args.facts + args.controls, args.seed)

    def ask(self, question: str, session: str | None) -> str:
        from py_engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=self.args.max_tokens)
        return self.sona.chat(user(question), params, session=session).text

    def record(self, i: int, session: str) -> dict:
        fact = self.facts[i]
        ids = self.sona.tokenizer.encode(self.sona._render(user(fact.question)), add_special_tokens=False)
        return {"id": f"fb-{i}", "session": session, "rating": -1, "correction": fact.reply,
                "prompt": {"token_ids": ids, "messages": user(fact.question)}}

    def teach(self, i: int, session: str) -> dict:
        """One correction: the time until the next request can use it, and where it went."""
        start = time.perf_counter()
        update = self.sona.learn(self.record(i, session))
        learned = time.perf_counter()
        if update.pattern is not None:
            self.sona.pattern_adapter(update.pattern)  # what the server folds and publishes
        end = time.perf_counter()
        stats = update.stats
        return {"ms": 1000 * (end - start), "fold_ms": 1000 * (end - learned),
                "train_ms": 1000 * stats.seconds if stats else 0.0, "steps": stats.steps if stats else 0}


def correct(text: str, fact: Fact) -> bool:
    return fact.answer in text.strip().split("\n")[0]


def base_answers(run: Run) -> dict:
    qs = [run.ask(f.question, None) for f in progress(run.facts, "base answers")]
    ps = [run.ask(f.paraphrase, None) for f in run.facts[:run.args.facts]]
    n = run.args.facts
    return {"question": qs, "paraphrase": ps,
            "question_accuracy": sum(correct(a, f) for a, f in zip(qs, run.facts)) / n if n else 0.0,
            "paraphrase_accuracy": sum(correct(a, f) for a, f in zip(ps, run.facts)) / n if n else 0.0}


def instant(run: Run, n: int, base: dict, gate_pairs: bool) -> dict:
    """Each of the first n facts in its own session: one correction, then the answers."""
    count = {"question": 0, "paraphrase": 0, "others_changed": 0, "other_session_changed": 0}
    others_asked, false_hits, pairs, updates = 0, 0, 0, []
    for i in progress(range(n), "facts"):
        fact, session = run.facts[i], f"fact-{i}"
        updates.append(run.teach(i, session))
        count["question"] += correct(run.ask(fact.question, session), fact)
        count["paraphrase"] += correct(run.ask(fact.paraphrase, session), fact)
        for k in range(1, run.args.others + 1):
            j = (i + k) % n
            count["others_changed"] += run.ask(run.facts[j].question, session) != base["question"][j]
            others_asked += 1
        count["other_session_changed"] += run.ask(fact.question, f"other-{i}") != base["question"][i]
        if gate_pairs and run.sona.recall is not None:
            for j in (j for j in range(n) if j != i):
                for text in (run.facts[j].question, run.facts[j].paraphrase):
                    false_hits += run.sona.route(session, text).match is not None
                    pairs += 1
    return {"facts": n, "question_accuracy": count["question"] / n, "paraphrase_accuracy": count["paraphrase"] / n,
            "others_changed": count["others_changed"] / max(1, others_asked), "others_asked": others_asked,
            "other_session_changed": count["other_session_changed"] / n,
            "gate_false_hits": false_hits / pairs if pairs else None, "gate_pairs": pairs,
            "update_ms": percentiles([u["ms"] for u in updates]),
            "train_ms": percentiles([u["train_ms"] for u in updates]),
            "fold_ms": percentiles([u["fold_ms"] for u in updates]),
            "steps": percentiles([u["steps"] for u in updates])}


def consolidation(run: Run, base: dict, base_ppl: float) -> dict:
    """After instant(): the taught patterns consolidated; a fresh session's answers and the controls."""
    n, result = run.args.facts, run.sona.consolidate()
    taught = run.facts[:n]
    q = sum(correct(run.ask(f.question, "fresh"), f) for f in progress(taught, "consolidated")) / n
    p = sum(correct(run.ask(f.paraphrase, "fresh"), f) for f in taught) / n
    controls = range(n, len(run.facts))
    changed = sum(run.ask(run.facts[j].question, "fresh") != base["question"][j] for j in controls)
    ppl = perplexity(run, run.sona.consolidated)
    recall = run.sona.recall  # the ablation: a promoted pattern brings the consolidated adapter alone
    recall.config = dataclasses.replace(recall.config, global_micro=False)
    q_alone = sum(correct(run.ask(f.question, "fresh"), f) for f in taught) / n
    p_alone = sum(correct(run.ask(f.paraphrase, "fresh"), f) for f in taught) / n
    recall.config = dataclasses.replace(recall.config, global_micro=True)
    windows = validation_windows(run)
    opened = sum(run.sona.route("fresh", w).match is not None for w in windows)
    return {"consolidated_alone_question_accuracy": q_alone, "consolidated_alone_paraphrase_accuracy": p_alone,
            "validation_windows": len(windows), "validation_windows_gated": opened,
            "steps": result.stats.steps,"examples": result.examples, "seconds": result.seconds, "fisher_seconds": result.fisher_seconds,
            "first_loss": result.stats.first_loss, "last_loss": result.stats.last_loss,
            "question_accuracy": q, "paraphrase_accuracy": p, "controls": len(controls),
            "controls_changed": changed / max(1, len(controls)), "validation_ppl": ppl,
            "validation_ppl_rise": ppl / base_ppl - 1}


def validation_windows(run: Run, chars: int = 400) -> list[str]:
    """The validation text perplexity is measured on, in pieces a request could send: the gate's view."""
    from py_engine.hub import resolve_model

    text = resolve_model(run.args.model) / "validation.txt"
    if not text.is_file():
        text = REPO / "benchmarks" / "data" / "stories_heldout.txt"
    body = text.read_text(encoding="utf-8")[:16 * run.args.ppl_tokens]
    return [body[i:i + chars] for i in range(0, len(body), chars)]


def perplexity(run: Run, modules) -> float:
    from py_engine.hub import resolve_model
    from py_engine.learning.lora import applied
    from py_engine.models.evaluate import perplexity as ppl

    text = resolve_model(run.args.model) / "validation.txt"
    if not text.is_file():
        text = REPO / "benchmarks" / "data" / "stories_heldout.txt"
    n = run.args.ppl_tokens
    ids = run.sona.tokenizer.encode(text.read_text(encoding="utf-8")[:16 * n], add_special_tokens=True)[:n]
    with applied(run.sona.model, modules):
        return ppl(run.sona.model, ids, min(run.sona.max_len, 512)).perplexity


def percentiles(values: list[float]) -> dict:
    v = sorted(values)
    if not v:
        return {"n": 0}
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"n": len(v), "p50": round(statistics.median(v), 2), "p90": round(pick(0.9), 2),
            "max": round(v[-1], 2), "mean": round(statistics.fmean(v), 2)}


def progress(items, label: str):
    items = list(items)
    for k, item in enumerate(items):
        print(f"\r  {label}: {k + 1}/{len(items)}", end="", file=sys.stderr, flush=True)
        yield item
    print(file=sys.stderr)


def table(result: dict) -> str:
    lines = ["| variant | facts | question acc | held-out paraphrase acc | other questions changed | "
             "other session changed | gate false hits | update p50 ms | p90 ms | steps p50 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    b = result["base"]
    lines.append(f"| base | {result['facts']} | {b['question_accuracy']:.2f} | {b['paraphrase_accuracy']:.2f} | "
                 "| | | | | |")
    for v in result["variants"].values():
        name = v["label"]
        hits = "" if v["gate_false_hits"] is None else f"{v['gate_false_hits']:.4f}"
        lines.append(f"| {name} | {v['facts']} | {v['question_accuracy']:.2f} | {v['paraphrase_accuracy']:.2f} | "
                     f"{v['others_changed']:.2f} | {v['other_session_changed']:.2f} | {hits} | "
                     f"{v['update_ms']['p50']:.0f} | {v['update_ms']['p90']:.0f} | {v['steps']['p50']:.0f} |")
    c = result.get("consolidation")
    if c:
        lines += ["", "| after consolidation, fresh session | question acc | paraphrase acc | untaught changed | "
                  "val ppl, adapter on every token | vs base | validation windows gated | s |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |",
                  f"| {c['examples']} patterns (consolidated + own MicroLoRA) | {c['question_accuracy']:.2f} | "
                  f"{c['paraphrase_accuracy']:.2f} | {c['controls_changed']:.2f} | {c['validation_ppl']:.3f} | "
                  f"{100 * c['validation_ppl_rise']:+.2f}% | {c.get('validation_windows_gated', '')} of "
                  f"{c.get('validation_windows', '')} | {c['seconds']:.1f} |"]
        if "consolidated_alone_question_accuracy" in c:
            lines.append(f"| the consolidated adapter alone | {c['consolidated_alone_question_accuracy']:.2f} | "
                         f"{c['consolidated_alone_paraphrase_accuracy']:.2f} | | | | | |")
    return "\n".join(lines)


def main() -> None:
    import torch

    args = parse_args()
    torch.set_num_threads(args.threads)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **machine(),
            "loadavg_start": os.getloadavg()}
    names = [n for n in args.variants.split(",") if n]
    model = Path(args.model).name if Path(args.model).exists() else args.model
    out = args.out or REPO / "benchmarks" / "results" / f"sona_gate_bench_{model}.json"
    first = Run(args, VARIANTS[names[0]][1])
    embedder = first.sona.recall.gate.cache.embedder if first.sona.recall is not None else None
    base = base_answers(first)
    result = {"meta": meta, "model": args.model, "command": " ".join(sys.argv[1:]), "facts": args.facts, "controls": args.controls,
              "others": args.others, "max_tokens": args.max_tokens, "config": json.loads(args.config),
              "base": {k: v for k, v in base.items() if k.endswith("accuracy")}, "variants": {}}
    result["base"]["validation_ppl"] = base_ppl = perplexity(first, None)
    for k, name in enumerate(names):
        print(f"{name}", file=sys.stderr)
        label, overrides = VARIANTS[name]
        run = first if k == 0 else Run(args, overrides, embedder)
        n = args.facts if k == 0 else min(args.ablation_facts, args.facts)
        result["variants"][name] = {**instant(run, n, base, gate_pairs=overrides.get("apply") is None),
                                    "label": label, "overrides": overrides}
        if k == 0 and not args.no_consolidate:
            result["consolidation"] = consolidation(run, base, base_ppl)
        meta["loadavg_end"] = os.getloadavg()
        out.write_text(json.dumps(result, indent=2) + "\n")  # after each variant: a cut run keeps what it did
        print(table(result), file=sys.stderr)
    svg = out.with_suffix(".svg")
    svg.write_text(draw(result))
    png = to_png(svg)
    print(table(result))
    print(f"\nwrote {out.name}, {svg.name}" + (f", {png.name}" if png else ""))


if __name__ == "__main__":
    main()
