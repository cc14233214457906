"""Prompt lookup speculation in the demo page, in headless Chromium (Web Worker, Pyodide, the page's wasm kernels).

The page creates its engine with speculative: {method: 'ngram'} and its "Speculative decoding" toggle sets each
request's `speculative`. The reference is the same page with the toggle off: on the built-in model (int4, the
wasm kernels), greedy tokens with speculation equal those without, token for token, for a grounded prompt (the
answer repeats the prompt), where drafts are kept (the stats say so), and for an ordinary one; the chat UI with
the toggle on gives the reply it gives with it off and shows the drafts kept. A tiny random Qwen2 (int4), in an
engine the page's module creates in a Web Worker with acceptance_floor 0 (drafting wherever a lookup matches, so
drafts are verified and rolled back although noise rarely repeats), gives the same tokens too.
"""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("playwright")

from tests.paths import BUILTIN  # noqa: E402
from tests.web.web_harness import browser, require_page, static_server, tiny_page  # noqa: E402

pytestmark = pytest.mark.slow
LOAD_TIMEOUT_MS = 180_000
VERSE = "ROMEO:\nBut soft, what light breaks?\n\n"
# grounded: text the built-in model (int4) goes on repeating, as an answer quoting its prompt does
PROMPTS = {"grounded": "ROMEO:\nI am a man,\nAnd I am a man, and a man,\n" * 2, "plain": "To be, or not"}


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    require_page()
    if not (BUILTIN / "model.safetensors").exists():
        pytest.skip("the built-in model is not trained here (make builtin)")
    root = tmp_path_factory.mktemp("web-spec")
    dist = tiny_page(root, builtin=True)
    from export.exporter import export_model
    from export.options import ExportOptions

    export_model(root / "qwen2", dist / "models" / "qwen2-int4", ExportOptions(precision="int4", target="web"))
    with static_server(dist) as base, browser(root / "profile") as (context, _):
        page = context.new_page()
        page.goto(f"{base}?model=models/tiny-shakespeare/&precision=int4&speculative=1")
        page.wait_for_function("['ready', 'error'].includes(document.body.dataset.status)", timeout=LOAD_TIMEOUT_MS)
        assert page.evaluate("document.body.dataset.status") == "ready", page.inner_text("#error")
        yield page


def _complete(page, prompt: str, speculative: bool) -> dict:
    return page.evaluate("""async ([prompt, speculative]) => {
        const engine = window.ruvllmDemo.engine;
        const r = await engine.completions.create({prompt, max_tokens: 32, temperature: 0, ignore_eos: true,
          return_token_ids: true, speculative});
        return {ids: r.choices[0].token_ids, stats: engine.lastStats}; }""", [prompt, speculative])


def test_page_speculation_changes_no_token(page):
    assert page.evaluate("document.body.dataset.device") == "wasm"
    load = page.evaluate("window.ruvllmDemo.engine.stats.speculative")
    assert load["enabled"] and load["method"] == "ngram", load
    runs = {}
    for name, prompt in PROMPTS.items():
        off, on = _complete(page, prompt, False), _complete(page, prompt, True)
        assert len(off["ids"]) == 32 and on["ids"] == off["ids"], name
        assert off["stats"]["speculative"] is None and on["stats"]["speculative"] is not None
        runs[name] = on["stats"]
    spec = runs["grounded"]["speculative"]
    assert spec["num_accepted_tokens"] > 0, runs["grounded"]
    assert runs["grounded"]["forwardPasses"] == 32 - spec["num_accepted_tokens"]


def test_page_toggle(page):
    page.fill("#max_tokens", "24")
    runs = {}
    for on in (False, True):
        page.set_checked("#speculative", on)
        page.click("#clear-chat")
        page.fill("#input", "Say it again: " + VERSE * 2)
        page.press("#input", "Enter")
        page.wait_for_function("window.ruvllmDemo.lastRun && window.ruvllmDemo.lastRun.done", timeout=60_000)
        runs[on] = page.evaluate("window.ruvllmDemo.lastRun")
    assert runs[True]["text"] == runs[False]["text"] and runs[True]["tokens"] == runs[False]["tokens"]
    assert runs[False]["speculative"] is None and runs[True]["speculative"] is not None
    shown = page.inner_text("#accepted")
    drafted = runs[True]["speculative"]["num_draft_tokens"]
    assert shown == (f"{runs[True]['speculative']['num_accepted_tokens']}/{drafted}" if drafted else "-")


RANDOM = """async ([prompts, n]) => {
    const { createEngine } = await import('./ruvllm/index.js');
    const here = (path) => new URL(path, location.href).href;
    const engine = await createEngine({ model: here('models/qwen2-int4/'), worker: true, precision: 'int4',
      device: 'wasm', pyodideURL: here('pyodide/'), wasmPaths: here('ort/'), ortURL: here('ort/ort.wasm.min.mjs'),
      wheelsURL: here('wheels/'), workerURL: here('ruvllm/worker.js'),
      speculative: { method: 'ngram', num_speculative_tokens: 4, prompt_lookup_min: 1, acceptance_floor: 0 } });
    const out = { load: engine.stats, runs: [] };
    for (const prompt of prompts) {
      const run = {};
      for (const speculative of [false, true]) {
        const r = await engine.completions.create({ prompt, max_tokens: n, temperature: 0, ignore_eos: true,
          return_token_ids: true, speculative });
        run[speculative] = { ids: r.choices[0].token_ids, stats: engine.lastStats };
      }
      out.runs.push(run);
    }
    await engine.dispose();
    return out; }"""


def test_page_random_model_verifies_drafts(page):
    got = page.evaluate(RANDOM, [["To be, or not", "ROMEO: ROMEO: ROMEO:"], 24])
    assert got["load"]["speculative"]["enabled"] and got["load"]["device"] == "wasm", got["load"]
    drafted = 0
    for run in got["runs"]:
        off, on = run["false"], run["true"]
        assert len(off["ids"]) == 24 and on["ids"] == off["ids"]
        spec = on["stats"]["speculative"]
        drafted += spec["num_draft_tokens"]
        assert on["stats"]["forwardPasses"] == 24 - spec["num_accepted_tokens"]
    assert drafted > 0
