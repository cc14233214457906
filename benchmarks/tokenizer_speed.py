"""Speed of py_engine.tokenizer against Hugging Face `tokenizers` (Rust).

Encodes 1 MB of English prose (built here, deterministically and offline:
docstrings of Python's stdlib mixed with paragraphs written for this
benchmark) with the Llama-3 and Qwen tokenizers:
once as a single string and once line by line (`encode` per line, no
`encode_batch`), each with a fresh tokenizer so the word cache starts cold
(best of three). HF's `encode` also builds offsets and token strings, which
we do not: the comparison is of ids, what an inference engine needs.
Also times loading each tokenizer.json (ours in a fresh interpreter, so
module import and regex compilation count) and checks the ids are equal.

Run: .venv/bin/python benchmarks/tokenizer_speed.py
Writes benchmarks/results/tokenizer_speed.json and prints a table.
"""
from __future__ import annotations

import ast
import json
import platform
import random
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from common import REPO  # noqa: E402  (also puts the clone's root on sys.path)
FIXTURES = REPO.parent / "shared" / "fixtures" / "tokenizers"
RESULTS = REPO / "benchmarks" / "results" / "tokenizer_speed.json"
MODELS = ["llama-3.2", "qwen2.5"]
SIZE = 1_000_000
REPEATS = 3  # best of: the machine is shared

PARAGRAPHS = """\
The river ran low that summer, and the mill stood idle for the first time in forty years. Children waded where \
the water had once been too deep for a grown man, and the old boatman sat on his porch and said nothing at all.
Nobody in the village could remember who had planted the orchard. Some said it was the schoolmaster's grandfather; \
others swore it had been there before the church, before the road, perhaps before the village itself.
She kept a notebook of the weather: the hour the frost lifted, the colour of the sky at dusk, the day the swallows \
left. Over the years the notebook grew into a small library, and the library into a kind of memory for everyone.
"You'll want to be careful on the north path," the innkeeper told them. "It's washed out past the second bridge, \
and they haven't fixed it since the storm in March." They thanked him, paid for the bread, and went anyway.
In the evenings the travellers compared maps. None of them agreed; each had been drawn by someone who had walked \
only part of the way and guessed the rest, which is, after all, how most maps of anything are made.
The letter arrived three weeks late, its envelope soft from the rain. Inside were two pages of careful handwriting, \
a pressed flower, and a railway ticket for a journey that had already left without its passenger.
Work on the bridge began in April. By June the stone piers were finished, and by August the first carts were \
crossing, their drivers slowing in the middle to look down at the water as if it might have changed its mind.
He had learned to read late, at nineteen, from a borrowed grammar and a newspaper he was not supposed to keep. \
Ever after he read everything: labels, notices, the backs of envelopes, the small print at the foot of contracts.
The market opened before dawn. Farmers arrived with baskets of apples, pears and late plums; a baker set out \
loaves still warm from the oven; and a woman sold honey from a cart painted the colour of the honey itself.
It isn't true that the town never changes. The bakery moved across the square in 1921, the clock tower was \
repaired twice, and the library's third floor, closed for decades, finally reopened to the public last spring.
""".splitlines()
WORDS = ("morning evening harbour lantern meadow carriage garden window kitchen station mountain valley village "
         "teacher farmer sailor doctor painter soldier merchant clerk widow stranger neighbour traveller "
         "quietly slowly suddenly carefully gladly rarely almost nearly perhaps certainly honestly").split()


def stdlib_docstrings() -> list[str]:
    """English docstrings of the stdlib's top-level modules, read without importing them."""
    docs = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
        docs += [d for d in map(ast.get_docstring, nodes) if d and len(d) > 200]
    return docs


def make_prose(size: int = SIZE, seed: int = 0) -> str:
    """About `size` characters of English: stdlib docstrings (real, varied
    vocabulary) interleaved with the narrative paragraphs above, reshuffled
    and with a few words swapped so no paragraph repeats exactly."""
    rng = random.Random(seed)
    sentences = [s.strip().rstrip(".") + "." for p in PARAGRAPHS for s in p.split(". ") if s.strip()]
    docs = stdlib_docstrings()
    rng.shuffle(docs)
    parts, total = [], 0
    while total < size:
        words = " ".join(rng.sample(sentences, rng.randint(2, 6))).split(" ")
        for _ in range(rng.randint(1, 4)):
            words[rng.randrange(len(words))] = rng.choice(WORDS)
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(1, 99999)))
        parts.append(" ".join(words))
        if docs:
            parts.append(docs.pop())
        total += len(parts[-1]) + len(parts[-2]) + 2
    return "\n".join(parts)[:size]


def cold_load_seconds(path: Path) -> float:
    """Import plus from_file in a fresh interpreter (what a user waits for)."""
    code = ("import time; t = time.perf_counter(); from py_engine.tokenizer import Tokenizer; "
            f"Tokenizer.from_file({str(path)!r}); print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def bench_model(name: str, text: str) -> dict:
    import tokenizers

    from py_engine.tokenizer import Tokenizer

    path = FIXTURES / name / "tokenizer.json"
    mb = len(text.encode("utf-8")) / 1e6
    lines = text.split("\n")
    hf_load, _ = timed(lambda: tokenizers.Tokenizer.from_file(str(path)))
    row = {"model": name, "mb": round(mb, 3), "load_ours_s": cold_load_seconds(path), "load_hf_s": hf_load}
    for mode in ("whole", "lines"):
        best_ours = best_hf = float("inf")
        for _ in range(REPEATS):  # fresh tokenizers each time: the word caches start cold
            ours, hf = Tokenizer.from_file(path), tokenizers.Tokenizer.from_file(str(path))
            if mode == "whole":
                t_ours, ids_ours = timed(lambda: ours.encode(text, add_special_tokens=False))
                t_hf, ids_hf = timed(lambda: hf.encode(text, add_special_tokens=False).ids)
            else:
                t_ours, ids_ours = timed(lambda: [ours.encode(line, add_special_tokens=False) for line in lines])
                t_hf, ids_hf = timed(lambda: [hf.encode(line, add_special_tokens=False).ids for line in lines])
            best_ours, best_hf = min(best_ours, t_ours), min(best_hf, t_hf)
        row[f"{mode}_ours_mb_s"] = mb / best_ours
        row[f"{mode}_hf_mb_s"] = mb / best_hf
        row[f"{mode}_ids_equal"] = ids_ours == ids_hf
        if mode == "whole":
            row["n_tokens"] = len(ids_ours)
    return row


def main() -> None:
    text = make_prose()
    rows = [bench_model(name, text) for name in MODELS if (FIXTURES / name / "tokenizer.json").is_file()]
    if not rows:
        sys.exit(f"no tokenizer fixtures under {FIXTURES}")
    header = (f"{'model':<10} {'mode':<6} {'ours MB/s':>10} {'HF MB/s':>9} {'ours/HF':>8} {'ids =':>6}"
              f" {'load ours s':>12} {'load HF s':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        for mode in ("whole", "lines"):
            ours, hf = r[f"{mode}_ours_mb_s"], r[f"{mode}_hf_mb_s"]
            print(f"{r['model']:<10} {mode:<6} {ours:>10.2f} {hf:>9.2f} {ours / hf:>8.2f} "
                  f"{str(r[f'{mode}_ids_equal']):>6} {r['load_ours_s']:>12.2f} {r['load_hf_s']:>10.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "machine": platform.machine(), "text_mb": rows[0]["mb"]}
    RESULTS.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {RESULTS.relative_to(REPO)}")
    if not all(r["whole_ids_equal"] and r["lines_ids_equal"] for r in rows):
        sys.exit("ids differ from tokenizers")


if __name__ == "__main__":
    main()
