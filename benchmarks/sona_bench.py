"""Learning from feedback, measured: adaptation, the instant loop, forgetting with and without EWC, latency.

    python benchmarks/sona_bench.py                                   # the built-in model
    python benchmarks/sona_bench.py --model smollm2-135m-instruct --epochs 8

Task (sona_task.py): 50 invented facts, each a question and a paraphrase (100
Q/A pairs). Corrections are given on the questions; the paraphrases are held out.
- base: greedy accuracy (the answer word in the reply) and mean NLL per answer token.
- instant loop: for `--instant-facts` facts, each in a fresh session, 1..5 corrections
  of its question; after each, is the session's next greedy answer correct (question,
  paraphrase), did it change from the base's, and does the session now give that answer to
  another fact's question too ("leaked": a MicroLoRA of one fact overfits)? Update time p50/p99 (train + the
  fold that publishes it) and the fold alone; another session's answers must stay the base's.
- consolidation: the 50 corrections replayed into one LoRA, with EWC and without
  (the ablation): accuracy and NLL on questions and paraphrases, the base's
  validation perplexity before and after, and the time it took.
Writes benchmarks/results/sona_bench_<model>.json, prints a table, draws an SVG.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from common import REPO  # noqa: E402  (also puts the clone's root on sys.path)

from common import machine  # noqa: E402
from sona_plot import draw  # noqa: E402
from sona_task import Fact, facts  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-shakespeare")
    p.add_argument("--facts", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--instant-facts", type=int, default=10)
    p.add_argument("--micro-steps", type=int, default=3)
    p.add_argument("--micro-lr", type=float, default=5e-2)
    p.add_argument("--micro-rank", type=int, default=2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--layers", type=int, default=0, help="layers of the consolidated LoRA from the last (0: all)")
    p.add_argument("--micro-layers", type=int, default=2)
    p.add_argument("--fisher-tokens", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--ewc-lambda", type=float, default=10.0)
    p.add_argument("--ewc-sweep", default="0.3,1,3", help="more EWC strengths to consolidate with (the trade-off)")
    p.add_argument("--ppl-tokens", type=int, default=8192)
    p.add_argument("--text-file", type=Path, help="validation text (default: the model folder's, else "
                                                 "benchmarks/data/stories_heldout.txt)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (2 oversubscribe a shared 2-core machine)")
    p.add_argument("--out", type=Path)
    return p.parse_args()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from py_engine.chat import load_chat_config, render_chat
        from py_engine.hub import resolve_model
        from py_engine.learning import Sona, SonaConfig

        torch.set_num_threads(args.threads)
        self.args = args
        self.config = SonaConfig(micro_rank=args.micro_rank, micro_steps=args.micro_steps, micro_lr=args.micro_lr,
                                 micro_layers=args.micro_layers, rank=args.rank, layers=args.layers,
                                 epochs=args.epochs, lr=args.lr, ewc_lambda=args.ewc_lambda,
                                 fisher_tokens=args.fisher_tokens, consolidate_every=0, seed=args.seed)
        self.sona = Sona.load(args.model, self.config)
        self.path = resolve_model(args.model)
        chat = load_chat_config(self.path)
        tok = self.sona.tokenizer

        def ids(question: str) -> list[int]:
            text = render_chat([{"role": "user", "content": question}], chat, add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False)
        self.facts: list[Fact] = facts(args.facts, args.seed)
        self.q_ids = [ids(f.question) for f in self.facts]
        self.p_ids = [ids(f.paraphrase) for f in self.facts]

    def record(self, i: int, session: str | None) -> dict:
        return {"session": session, "prompt": {"token_ids": self.q_ids[i]}, "rating": -1,
                "correction": self.facts[i].reply}

    def answer(self, prompt: list[int], session: str | None) -> str:
        from py_engine.sampling_params import SamplingParams

        return self.sona.generate(prompt, SamplingParams(temperature=0, max_tokens=8), session=session).text

    def correct(self, text: str, fact: Fact) -> bool:
        return fact.answer in text.strip().split("\n")[0]

    def evaluate(self, which: list[int], session: str | None = None) -> dict:
        """Accuracy and answer NLL on the questions and the paraphrases of facts `which`."""
        from py_engine.learning.lora import applied
        from py_engine.learning.objective import mean_nll

        out = {}
        for kind, prompts in (("question", self.q_ids), ("paraphrase", self.p_ids)):
            answers = [self.answer(prompts[i], session) for i in which]
            out[f"{kind}_accuracy"] = sum(self.correct(a, self.facts[i]) for a, i in zip(answers, which)) / len(which)
            examples = [self.sona.example({"prompt": {"token_ids": prompts[i]}, "correction": self.facts[i].reply})
                        for i in which]
            with applied(self.sona.model, self.sona.adapter_for(session)):
                out[f"{kind}_nll"] = mean_nll(self.sona.model, examples)
        return out

    def perplexity(self, modules) -> float:
        from py_engine.learning.lora import applied
        from py_engine.models.evaluate import perplexity

        if not hasattr(self, "ppl_ids"):
            text = self.args.text_file or (self.path / "validation.txt")
            if not text.is_file():
                text = REPO / "benchmarks" / "data" / "stories_heldout.txt"
            self.ppl_text = str(text.relative_to(REPO) if text.is_relative_to(REPO) else text)
            raw = text.read_text(encoding="utf-8")[: 16 * self.args.ppl_tokens]
            self.ppl_ids = self.sona.tokenizer.encode(raw, add_special_tokens=True)[: self.args.ppl_tokens]
        window = min(self.sona.max_len, 512)
        with applied(self.sona.model, modules):
            return perplexity(self.sona.model, self.ppl_ids, window).perplexity

    def instant(self) -> dict:
        """Fresh session per fact, 1..5 corrections each; answers after each correction."""
        n = min(self.args.instant_facts, len(self.facts))
        curve = {c: {"question": 0, "paraphrase": 0, "changed": 0, "leaked": 0} for c in range(1, 6)}
        updates, folds = [], []
        base_q = [self.answer(self.q_ids[i], None) for i in range(n)]
        for i in range(n):
            session = f"fact-{i}"
            for c in range(1, 6):
                start = time.perf_counter()
                self.sona.learn(self.record(i, session))
                t_fold = time.perf_counter()
                self.sona.adapter_for(session)  # what the server publishes after each update
                end = time.perf_counter()
                updates.append(end - start)
                folds.append(end - t_fold)
                q = self.answer(self.q_ids[i], session)
                curve[c]["question"] += self.correct(q, self.facts[i])
                curve[c]["paraphrase"] += self.correct(self.answer(self.p_ids[i], session), self.facts[i])
                curve[c]["changed"] += q != base_q[i]
                other = (i + 1) % len(self.facts)  # another fact's question in the same session
                curve[c]["leaked"] += self.facts[i].answer in self.answer(self.q_ids[other], session)
        untouched = all(self.answer(self.q_ids[i], "nobody") == base_q[i] for i in range(n))
        self.sona.sessions.clear()
        self.sona.replay.clear()
        return {"facts": n, "after_corrections": {c: {k: v / n for k, v in d.items()} for c, d in curve.items()},
                "update_ms": _percentiles(updates), "fold_ms": _percentiles(folds),
                "other_session_unchanged": untouched}

    def consolidation(self, lam: float, train: list[int]) -> dict:
        self.sona.replay = [self.record(i, None) for i in train]
        self.sona.consolidated = None
        result = self.sona.consolidate(ewc_lambda=lam)
        scores = self.evaluate(train)
        ppl = self.perplexity(self.sona.consolidated)
        return {"ewc_lambda": lam, "seconds": result.seconds, "fisher_seconds": result.fisher_seconds,
                "train_seconds": result.stats.seconds, "steps": result.stats.steps,
                "first_loss": result.stats.first_loss, "last_loss": result.stats.last_loss,
                "validation_ppl": ppl, **scores}


def _percentiles(seconds: list[float]) -> dict:
    ms = sorted(s * 1000 for s in seconds)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return {"n": len(ms), "p50": round(statistics.median(ms), 3), "p99": round(pick(0.99), 3),
            "mean": round(statistics.fmean(ms), 3)}


def table(result: dict) -> str:
    base, rows = result["base"], []
    rows.append(("base", base, base["validation_ppl"], None))
    for c in result["consolidation"]:
        name = f"consolidated, EWC {c['ewc_lambda']:g}" if c["ewc_lambda"] else "consolidated, no EWC"
        rows.append((name, c, c["validation_ppl"], c["seconds"]))
    rows += [(f"EWC {c['ewc_lambda']:g} (sweep)", c, c["validation_ppl"], c["seconds"]) for c in result["ewc_sweep"]]
    lines = ["| model state | question acc | paraphrase acc | question NLL | paraphrase NLL | val ppl | vs base | s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s, ppl, secs in rows:
        rise = f"{100 * (ppl / base['validation_ppl'] - 1):+.2f}%" if secs is not None else ""
        lines.append(f"| {name} | {s['question_accuracy']:.2f} | {s['paraphrase_accuracy']:.2f} | "
                     f"{s['question_nll']:.3f} | {s['paraphrase_nll']:.3f} | {ppl:.3f} | {rise} | "
                     f"{'' if secs is None else f'{secs:.1f}'} |")
    inst = result["instant"]
    lines += ["", "| corrections in the session | 1 | 2 | 3 | 4 | 5 |", "| --- | --- | --- | --- | --- | --- |"]
    for key in ("question", "paraphrase", "changed", "leaked"):
        lines.append(f"| {key} | " + " | ".join(f"{inst['after_corrections'][c][key]:.2f}" for c in range(1, 6)) + " |")
    lines.append(f"\ninstant update (train {result['config']['micro_steps']} steps + fold): p50 "
                 f"{inst['update_ms']['p50']:.1f} ms, p99 {inst['update_ms']['p99']:.1f} ms; the fold alone p50 "
                 f"{inst['fold_ms']['p50']:.3f} ms, p99 {inst['fold_ms']['p99']:.3f} ms; another session unchanged: "
                 f"{inst['other_session_unchanged']}")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **machine()}
    bench = Bench(args)
    everything = list(range(len(bench.facts)))
    result = {"meta": meta, "model": args.model, "config": bench.config.__dict__ | {"target_modules": list(
        bench.config.target_modules)}, "task": {"facts": len(bench.facts), "pairs": 2 * len(bench.facts)}}
    result["base"] = {**bench.evaluate(everything), "validation_ppl": bench.perplexity(None)}
    result["validation_text"] = bench.ppl_text
    result["instant"] = bench.instant()
    sweep = [float(x) for x in args.ewc_sweep.split(",") if x.strip()]
    result["consolidation"] = [bench.consolidation(lam, everything) for lam in (args.ewc_lambda, 0.0)]
    result["ewc_sweep"] = [bench.consolidation(lam, everything) for lam in sweep]
    meta["loadavg_end"] = __import__("os").getloadavg()
    name = Path(args.model).name if Path(args.model).exists() else args.model
    out = args.out or REPO / "benchmarks" / "results" / f"sona_bench_{name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    svg = out.with_suffix(".svg")
    svg.write_text(draw(result))
    print(table(result))
    print(f"\nwrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out} and {svg.name}")


if __name__ == "__main__":
    main()
