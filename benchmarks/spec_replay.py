"""Prompt lookup replayed over fixed greedy answers: tokens a step and the speed a step cost model gives, no model.

    .venv/bin/python benchmarks/spec_replay.py                          # rows at 0.2 and 0.14 of a decode step
    .venv/bin/python benchmarks/spec_replay.py --row-costs 0.1 --drafts 4,8,16

Speculation changes no token, so which drafts a proposer gets accepted is fixed by the greedy answer: this reads
spec_decode.py's answers (results/spec_decode.json, the plain configuration's tokens of its first round), replays
py_engine.speculative's NgramLookup and DraftLength over them, and prices each step as 1 + ROW * drafts (+ 0.05
for a step that drafts) decode steps. It prints tokens a step and x plain for each draft length, beside an oracle
that drafts exactly the tokens the lookup would get accepted (the lookup's own bound). The row cost is what
spec_decode.py's engine part measures (a verify step of T rows against a decode step); the replay says how far a
cheaper row or another draft rule can take a set, before timing it.
"""
from __future__ import annotations

import argparse
import json

from common import REPO

from py_engine.speculative.ngram import NgramLookup
from py_engine.speculative.stats import DraftLength, StepCosts

ANSWERS = REPO / "benchmarks" / "results" / "spec_decode.json"
DRAFTING = 0.05  # a step that drafts: proposing, the rows' bookkeeping (decode steps)


def sequences(path) -> dict[str, list[tuple[list[int], list[int]]]]:
    """{set: [(prompt ids, answer ids)]} from spec_decode.py's plain answers, prompts as its engine part sends them."""
    import spec_decode
    from py_engine import LLM

    run = next(r for r in json.loads(path.read_text())["engine"]["runs"] if r["config"] == "plain")
    llm = LLM(spec_decode.NAME)  # its chat template and tokenizer (the weights load too: a few seconds)
    out = {}
    for name, prompts in spec_decode.SETS.items():
        out[name] = []
        for question, answer in zip(prompts, run["sets"][name]):
            text = llm.chat_prompt([{"role": "user", "content": question}])
            out[name].append((list(llm.tokenizer.encode(text, add_special_tokens=False)), answer["tokens"]))
    return out


def replay(seqs, k_max: int, row: float, oracle: bool = False, floor: float = 0.2) -> tuple[float, float]:
    """(tokens a step, x plain) over the sequences."""
    cost = lambda drafts: 1 + (row * drafts + DRAFTING if drafts else 0)  # noqa: E731
    steps = tokens = spent = 0.0
    for prompt, answer in seqs:
        costs = StepCosts(k_max)
        for k in range(k_max + 1):
            costs.record(k, cost(k))
        length = DraftLength(floor, k_max, costs)
        lookup = NgramLookup(prompt)
        lookup.extend(answer[:1])  # the prefill's token
        i = 1
        while i < len(answer):
            room = len(answer) - i - 1
            k = k_max if oracle else length.choose(room)
            drafts = lookup.propose(min(k, room)) if k > 0 else []
            kept = 0
            while kept < len(drafts) and drafts[kept] == answer[i + kept]:
                kept += 1
            if oracle:
                drafts = drafts[:kept]
            length.record(len(drafts), kept)
            lookup.extend(answer[i:i + kept + 1])
            i += kept + 1
            steps += 1
            tokens += kept + 1
            spent += cost(len(drafts))
    return tokens / steps, tokens / spent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--answers", default=str(ANSWERS))
    p.add_argument("--row-costs", default="0.2,0.14")
    p.add_argument("--drafts", default="4,8,16")
    args = p.parse_args()
    from pathlib import Path

    data = sequences(Path(args.answers))
    print("| set | row cost | drafts | tokens a step | x plain | oracle tokens a step | oracle x plain |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, seqs in data.items():
        for row in map(float, args.row_costs.split(",")):
            for k in map(int, args.drafts.split(",")):
                t, x = replay(seqs, k, row)
                ot, ox = replay(seqs, k, row, oracle=True)
                print(f"| {name} | {row} | {k} | {t:.2f} | x{x:.2f} | {ot:.2f} | x{ox:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
