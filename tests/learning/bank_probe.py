"""The pattern store and gate on given embeddings: run by CPython and by Pyodide (tests/learning/js).

Reads INPUT (a JSON file: dim, patterns [{id, session, question, answer, embedding}], probes [{session, text,
embedding}], promote [ids], remove [ids]); prints one JSON line: each probe's match (pattern id, similarity) before and after
the removals and after a replay of the bank's event file. Stdlib only, as in the page.
"""
import json
import tempfile

from py_engine.learning.bank import BankConfig, Gate, Pattern, PatternBank
from py_engine.learning.bank.gate import keywords


class Lookup:
    def __init__(self, table, dim):
        self.table, self.dim = table, dim

    def embed(self, texts):
        return [self.table[t] for t in texts]


def matches(gate, probes):
    out = []
    for p in probes:
        m = gate.match(p["session"], p["text"])
        out.append(None if m is None else [m.pattern.id, round(m.similarity, 9)])
    return out


def main(path):
    data = json.load(open(path))
    table = {p["text"]: p["embedding"] for p in data["probes"]}
    folder = tempfile.mkdtemp()
    bank = PatternBank(BankConfig(index_backend="exact"), folder=folder)
    for p in data["patterns"]:
        bank.add(Pattern(id=p["id"], session=p["session"], question=p["question"], answer=p["answer"],
                         embedding=tuple(p["embedding"]), keywords=keywords(p["question"])))
    bank.promote(data["promote"], 1)  # consolidation version 1 makes these global
    gate = Gate(bank, Lookup(table, data["dim"]), threshold=data["threshold"])
    before = matches(gate, data["probes"])
    for pid in data["remove"]:
        bank.remove(pid)
    after = matches(gate, data["probes"])
    replayed = PatternBank(BankConfig(index_backend="exact"), folder=folder)
    again = matches(Gate(replayed, Lookup(table, data["dim"]), threshold=data["threshold"]), data["probes"])
    print(json.dumps({"before": before, "after": after, "replayed": again, "size": len(replayed)}))


main(INPUT)  # noqa: F821 (set by the runner: CPython's test or the Pyodide script)
