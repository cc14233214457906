"""Prompt lookup speculation in the npm package, packed and installed in a scratch project, in Node.

createEngine({speculative: {method: 'ngram', ...}}) (vLLM's field names) drafts with py_engine.speculative's
prompt lookup in Pyodide and verifies the drafts in one pass of the package's wasm kernels (rows that are
decode's bits: tests/web/test_wasm_kernels.py). The reference is the same package with speculation off: the
greedy tokens, streamed or not, and a seeded sampled answer (repetition penalty included: it counts drafts kept
earlier in a pass) are equal token for token, on the built-in model (int8) and a tiny random Qwen2 (int4). A
grounded prompt (the answer repeats the prompt) has drafts accepted: the stats say so and the engine ran fewer
forward passes than it produced tokens; on the random model (whose noise prompt lookup rarely guesses) drafts are
verified and rolled back. A bad config is an InvalidRequestError naming `speculative`.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.paths import BUILTIN, REPO  # noqa: E402
from tests.requires import tool  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402
from tests.web.npm_project import install_packed, run as _run  # noqa: E402

pytestmark = pytest.mark.slow
DRIVER = REPO / "tests" / "web" / "npm" / "speculative.mjs"
VERSE = "ROMEO:\nBut soft, what light breaks?\n\n"  # the tiny models take 128 positions
REQUESTS = [
    # the answer repeats the prompt: prompt lookup's case
    {"name": "grounded", "kind": "text", "prompt": VERSE * 3 + "ROMEO:\nBut soft,", "max_tokens": 32,
     "temperature": 0, "ignore_eos": True},
    {"name": "plain", "kind": "text", "prompt": "To be, or not", "max_tokens": 40, "temperature": 0,
     "ignore_eos": True, "stream": True},
    # seeded sampling with a repetition penalty (which counts the drafts kept earlier in a pass), on a prompt
    # the built-in model loops on, so some drafts are kept
    {"name": "sampled", "kind": "text", "prompt": "ROMEO:\nI am a man,\nAnd I am a man, and a man,\n" * 2,
     "max_tokens": 24,
     "temperature": 0.3, "top_k": 20,
     "seed": 11, "repetition_penalty": 1.02, "ignore_eos": True},
    {"name": "off", "kind": "text", "prompt": VERSE * 2, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
     "speculative": False},
]
# acceptance_floor 0: draft at every step a lookup matches, however few drafts were kept, so the verify pass and
# the rollback of rejected drafts run often (the default stops drafting below 0.2 acceptance)
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
               "acceptance_floor": 0}


def _web_export(model: Path, out: Path, precision: str) -> Path:
    from export.exporter import export_model
    from export.options import ExportOptions

    export_model(model, out, ExportOptions(precision=precision, target="web"))
    return out


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("npm-spec")
    project = install_packed(root, root / "app")
    shutil.copy(DRIVER, project / DRIVER.name)
    models = [{"name": "qwen2", "precision": "int4",
               "path": str(_web_export(build_tiny_model(root / "qwen2", "qwen2"), root / "qwen2-web", "int4"))}]
    if (BUILTIN / "model.safetensors").exists():
        models.insert(0, {"name": "builtin", "precision": "int8",
                          "path": str(_web_export(BUILTIN, root / "builtin-web", "int8"))})
    spec = root / "spec.json"
    spec.write_text(json.dumps({"models": models, "requests": REQUESTS, "speculative": SPECULATIVE,
                                "bad": {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}}))
    done = _run([tool("node"), DRIVER.name, str(spec)], project, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    out["models"] = [m["name"] for m in models]
    print(json.dumps({k: (len(v["token_ids"]), v["stats"]["forwardPasses"], v["stats"]["speculative"])
                      for k, v in out["runs"].items()}))  # shown with -s
    return out


def test_same_tokens_with_and_without_speculation(result):
    for model in result["models"]:
        assert result["load"][f"{model}/off"] is None
        load = result["load"][f"{model}/on"]
        assert load["enabled"] and load["prompt_lookup_max"] == 4 and load["num_speculative_tokens"] == 4, load
        for request in REQUESTS:
            off, on = result["runs"][f"{model}/off/{request['name']}"], result["runs"][f"{model}/on/{request['name']}"]
            assert 8 <= len(off["token_ids"]) <= request["max_tokens"]  # the context may end it first
            assert on["token_ids"] == off["token_ids"], (model, request["name"])
            assert on["text"] == off["text"]
            assert off["stats"]["speculative"] is None
            assert off["stats"]["forwardPasses"] == len(off["token_ids"])


def test_grounded_prompt_accepts_drafts(result):
    for model in result["models"]:
        for request in REQUESTS[:3]:
            stats = result["runs"][f"{model}/on/{request['name']}"]["stats"]
            spec = stats["speculative"]
            # every kept draft is a forward pass saved
            assert stats["forwardPasses"] == stats["completionTokens"] - spec["num_accepted_tokens"], (model, stats)
        # drafts were verified (and rejected ones rolled back) on every model ...
        assert sum(result["runs"][f"{model}/on/{r['name']}"]["stats"]["speculative"]["num_draft_tokens"]
                   for r in REQUESTS[:3]) > 0, model
    if "builtin" in result["models"]:  # ... and a trained model's grounded answer keeps many of them
        spec = result["runs"]["builtin/on/grounded"]["stats"]["speculative"]
        assert spec["num_accepted_tokens"] > 0 and spec["acceptance_rate"] > 0.3, spec
        assert result["runs"]["builtin/on/sampled"]["stats"]["speculative"]["num_accepted_tokens"] > 0
    # a request can turn it off
    assert result["runs"][f"{result['models'][0]}/on/off"]["stats"]["speculative"] is None


def test_bad_config_is_a_clear_error(result):
    bad = result["errors"]["bad"]
    assert bad["invalid"] and bad["param"] == "speculative", bad
    assert "prompt_lookup_min" in bad["message"], bad
