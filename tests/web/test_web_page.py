"""The demo page in headless Chromium (Playwright), served the way `ruvllm serve` serves web/dist.

Golden matrix (browser leg): greedy tokens from the page's engine (Web Worker, Pyodide +
onnxruntime-web wasm) equal the torch engine's, for random-weight models of two families
and the built-in model when trained; on the built-in model, structured outputs and forced tool
calls give CPython's seeded tokens (tests/guided_cases.py). The page renders its chat UI (screenshot), streams a
reply, stops on request, loads the model from the browser's cache after a reload (no second
download), reports a missing model and an unsupported browser as readable errors, sends the
same conversation to a real `ruvllm serve` with the same greedy reply, and makes no request
outside 127.0.0.1.

Needs Debian's Chromium (/usr/bin/chromium), Python's playwright (no browser download) and
npm/node_modules (`npm ci --prefix npm`); skips, saying which, when one is missing.
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")
pytest.importorskip("playwright")

from tests.paths import BUILTIN, REPO  # noqa: E402
from tests.guided_cases import GUIDED, check_guided_run  # noqa: E402
from tests.web.web_harness import browser, require_page, static_server, tiny_page  # noqa: E402

PROMPT = "To be, or not"
GREEDY = 48
LOAD_TIMEOUT_MS = 180_000

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    require_page()
    return tiny_page(tmp_path_factory.mktemp("web"), builtin=(BUILTIN / "model.safetensors").exists())


@pytest.fixture(scope="module")
def site(dist, tmp_path_factory):
    profile = tmp_path_factory.mktemp("profile")
    # ForceEagerMeasureMemory: measureUserAgentSpecificMemory answers at once, not at the next GC (up to 20 s)
    eager = ("--enable-blink-features=ForceEagerMeasureMemory",)
    with static_server(dist) as base, browser(profile, extra_args=eager) as (context, requests):
        yield base, context, requests


def _open(context, base: str, model: str, precision: str = "fp32"):
    page = context.new_page()
    page.goto(f"{base}?model=models/{model}/&precision={precision}")
    page.wait_for_function("['ready', 'error'].includes(document.body.dataset.status)", timeout=LOAD_TIMEOUT_MS)
    error = page.inner_text("#error")
    assert page.evaluate("document.body.dataset.status") == "ready", error
    return page


def _menu_models(dist: Path) -> list[str]:
    import json

    return [m["name"] for m in json.loads((dist / "models" / "index.json").read_text())]


def test_golden_greedy_tokens_in_chromium(site, dist):
    from py_engine import LLM, SamplingParams

    base, context, _ = site
    params = SamplingParams.greedy(max_tokens=GREEDY, ignore_eos=True)
    names = _menu_models(dist)
    assert {"qwen2", "llama"} <= set(names)
    for name in names:
        source = BUILTIN if name == "tiny-shakespeare" else dist.parent / name
        expected = LLM(str(source)).generate(PROMPT, params).token_ids
        page = _open(context, base, name)
        assert page.evaluate("crossOriginIsolated") is True  # COOP/COEP on every response: threaded wasm
        got = page.evaluate("""async ([prompt, n]) => {
            const r = await window.ruvllmDemo.engine.completions.create(
              {prompt, max_tokens: n, temperature: 0, ignore_eos: true, return_token_ids: true});
            return r.choices[0].token_ids; }""", [PROMPT, GREEDY])
        assert got == expected, name
        # Python came from a heap snapshot: the one `web build` shipped (web/snapshot.py), or this browser's copy
        assert page.evaluate("window.ruvllmDemo.engine.stats.pythonStart") in ("shipped", "cached"), name
        if name == "tiny-shakespeare":  # on the same page (one model load): structured outputs and tools
            check_guided_run(_guided_in_page(page), dist / "models" / name, strict=True)
        page.close()


def test_smollm2_int4_greedy_chat_in_chromium(site, dist, smollm2_web):
    """Golden matrix, SmolLM2 (a real 135M chat model, its Q4_1 GGUF exported int4 for the web, as
    `ruvllm web build` serves it): the page's engine gives onnxruntime-in-CPython's greedy chat replies."""
    import shutil

    from tests.web.smollm2_golden import CHATS, JS_CHATS, MAX_TOKENS, PRECISION, check_greedy

    base, context, _ = site
    shutil.copytree(smollm2_web.export, dist / "models" / "smollm2")
    page = _open(context, base, "smollm2", PRECISION)
    got = page.evaluate(f"async ([chats, n]) => await ({JS_CHATS})(window.ruvllmDemo.engine, chats, n)",
                        [CHATS, MAX_TOKENS])
    check_greedy(got, smollm2_web, "the page in Chromium")
    # the codes ran on the page's own kernels (relaxed SIMD in this Chromium), and the page says so
    assert page.evaluate("document.body.dataset.device") == "wasm"
    assert page.inner_text("#device").startswith("ruvllm-wasm (relaxed SIMD")
    # Chromium's count of the tab (JS heaps and array buffers, the kernels' shared memory; not Pyodide's own wasm
    # heap): the model's bytes once plus ~12 MiB, where a restored Python snapshot kept alive was 30 MiB more
    counted = page.evaluate("async () => (await performance.measureUserAgentSpecificMemory()).bytes")
    model_bytes = sum(f.stat().st_size for f in smollm2_web.export.rglob("*") if f.is_file())
    assert counted < 1.3 * model_bytes, (counted / 2**20, model_bytes / 2**20)
    page.close()


def test_k_quant_gguf_web_export_in_chromium(site, dist, kquant_web):
    """Issue 31: a GGUF K-quant mix exported int4 for the web (tests/web/kquant_web.py) runs on the page's own
    kernels with onnxruntime-in-CPython's greedy tokens."""
    import shutil

    from tests.web.kquant_web import MAX_TOKENS, PRECISION, PROMPT
    from tests.web.smollm2_golden import check_greedy

    base, context, _ = site
    shutil.copytree(kquant_web.export, dist / "models" / "q4_k_m")
    page = _open(context, base, "q4_k_m", PRECISION)
    got = page.evaluate("""async ([prompt, n]) => {
        const r = await window.ruvllmDemo.engine.completions.create(
          {prompt, max_tokens: n, temperature: 0, ignore_eos: true, return_token_ids: true});
        return r.choices[0].token_ids; }""", [PROMPT, MAX_TOKENS])
    check_greedy([got], kquant_web, "the page in Chromium, K-quant GGUF")
    assert page.evaluate("document.body.dataset.device") == "wasm"
    page.close()


def _guided_in_page(page) -> dict:
    """tests/npm/guided_requests.mjs's guided() run by the page's engine (Web Worker, Pyodide)."""
    source = (REPO / "tests" / "web" / "npm" / "guided_requests.mjs").read_text(encoding="utf-8").replace("export ", "")
    return page.evaluate(f"async (requests) => {{ {source}\n return await guided(window.ruvllmDemo.engine, requests); }}",
                         GUIDED)


def _send(page, text: str) -> dict:
    page.fill("#input", text)
    page.press("#input", "Enter")
    page.wait_for_function("window.ruvllmDemo.lastRun && window.ruvllmDemo.lastRun.done", timeout=60_000)
    return page.evaluate("window.ruvllmDemo.lastRun")


def test_chat_ui_streams_and_screenshot(site, tmp_path):
    base, context, _ = site
    page = _open(context, base, "qwen2")
    page.fill("#max_tokens", "24")
    run = _send(page, "To be, or not to be?")
    assert run["tokens"] >= 1 and run["finish"] in ("stop", "length")
    assert page.locator(".msg.user").inner_text().endswith("To be, or not to be?")
    assert page.locator(".msg.assistant .text").inner_text() == run["text"]
    for selector in ("#log", "#input", "#send", "#stop", "#temperature", "#top_p", "#max_tokens", "#system",
                     "#target", "#clear-cache", "#progress .file"):
        assert page.locator(selector).first.is_visible(), selector
    assert page.inner_text("#ttft").endswith("ms") and page.inner_text("#tps") != "-"
    shot = tmp_path / "page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    page.close()


def test_stop_button_ends_generation(site):
    base, context, _ = site
    page = _open(context, base, "llama")
    page.fill("#max_tokens", "100")
    page.fill("#temperature", "1")
    stop_after_two_tokens = """() => new Promise((resolve) => {
        const demo = window.ruvllmDemo, before = demo.lastRun;
        let clicked = false;
        document.getElementById('input').value = 'Whether';
        document.getElementById('composer').requestSubmit();
        const poll = setInterval(() => {
          const run = demo.lastRun === before ? null : demo.lastRun;
          if (run?.tokens >= 2 && !clicked) { clicked = true; document.getElementById('stop').click(); }
          if (run?.done) { clearInterval(poll); resolve(run); }
        }, 1);
      })"""
    # At temperature 1 the model may sample its end of text before the click's abort reaches the worker: that run
    # ends 'stop' on its own, and says nothing about the button, so it is tried again (a broken button never aborts).
    for _ in range(4):
        run = page.evaluate(stop_after_two_tokens)
        if run["finish"] != "stop":
            break
    assert run["finish"] == "abort" and run["tokens"] < 100
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    again = _send(page, "again")  # the engine is free after a stop
    assert again["finish"] in ("stop", "length")
    page.close()


def test_reload_loads_from_browser_cache(site, dist):
    base, context, requests = site
    _open(context, base, "qwen2").close()  # cached by now (earlier tests loaded it too)
    requests.clear()
    page = _open(context, base, "qwen2")
    assert not [u for u in requests if u.endswith(("model.onnx", "tokenizer.json"))], requests
    stats = page.evaluate("window.ruvllmDemo.engine.stats")
    assert stats["downloadedBytes"] == 0 and stats["cachedBytes"] > 0
    # Python restored from the heap snapshot the first load kept (npm/src/python.js), and it still answers
    # with the torch engine's greedy tokens
    assert stats["pythonRestored"] is True, stats
    from py_engine import LLM, SamplingParams

    expected = LLM(str(dist.parent / "qwen2")).generate(PROMPT, SamplingParams.greedy(max_tokens=8,
                                                                                      ignore_eos=True)).token_ids
    got = page.evaluate("""async ([prompt, n]) => (await window.ruvllmDemo.engine.completions.create(
        {prompt, max_tokens: n, temperature: 0, ignore_eos: true, return_token_ids: true})).choices[0].token_ids""",
                        [PROMPT, 8])
    assert got == expected
    page.click("#clear-cache")
    page.wait_for_function("document.body.dataset.status === 'cache cleared'")
    assert page.evaluate("caches.keys()") == []
    page.close()


@pytest.mark.parametrize("fault", ["stale key", "truncated heap", "heap past its size"])
def test_bad_shipped_snapshot_is_not_restored(site, dist, fault):
    """A python-snapshot.json whose key does not match the wheels the page installs (another build's heap),
    a gzipped heap cut short, or one that unpacks past the manifest's heap_bytes is not restored: Python boots,
    and the page still gives the torch engine's greedy tokens."""
    import json

    from py_engine import LLM, SamplingParams

    base, context, _ = site
    manifest = json.loads((dist / "wheels" / "python-snapshot.json").read_text())
    bad = {**manifest, "key": "0" * 64} if fault == "stale key" else dict(manifest)
    if fault == "heap past its size":
        bad["heap_bytes"] = manifest["heap_bytes"] - 1
    page = context.new_page()
    page.goto(base)  # several models and no ?model=: the page waits for a choice
    page.evaluate("async () => { for (const k of await caches.keys()) await caches.delete(k); }")
    page.route("**/wheels/python-snapshot.json", lambda route: route.fulfill(
        status=200, content_type="application/json", body=json.dumps(bad)))
    if fault == "truncated heap":
        gz = (dist / "wheels" / manifest["file"]).read_bytes()
        page.route(f"**/wheels/{manifest['file']}", lambda route: route.fulfill(
            status=200, content_type="application/gzip", body=gz[: len(gz) // 2]))
    page.goto(f"{base}?model=models/qwen2/&precision=fp32")
    page.wait_for_function("['ready', 'error'].includes(document.body.dataset.status)", timeout=LOAD_TIMEOUT_MS)
    assert page.evaluate("document.body.dataset.status") == "ready", page.inner_text("#error")
    assert page.evaluate("window.ruvllmDemo.engine.stats.pythonStart") == "boot"
    got = page.evaluate("""async ([prompt, n]) => (await window.ruvllmDemo.engine.completions.create(
        {prompt, max_tokens: n, temperature: 0, ignore_eos: true, return_token_ids: true})).choices[0].token_ids""",
                        [PROMPT, 8])
    page.close()
    expected = LLM(str(dist.parent / "qwen2")).generate(PROMPT, SamplingParams.greedy(max_tokens=8,
                                                                                      ignore_eos=True)).token_ids
    assert got == expected


def test_missing_model_is_a_readable_error(site):
    base, context, _ = site
    page = context.new_page()
    page.goto(f"{base}?model=models/nothing-here/")
    page.wait_for_function("document.body.dataset.status === 'error'", timeout=LOAD_TIMEOUT_MS)
    text = page.inner_text("#error")
    assert text.startswith("ModelNotFoundError") and "ruvllm_contract.json" in text
    page.close()


def test_unsupported_browser_is_a_readable_error(site):
    base, context, _ = site
    page = context.new_page()
    page.add_init_script("delete globalThis.WebAssembly;")  # a browser without wasm, before the page runs
    page.goto(f"{base}?model=models/qwen2/")
    page.wait_for_function("document.body.dataset.status === 'error'", timeout=60_000)
    text = page.inner_text("#error")
    assert text.startswith("UnsupportedRuntimeError") and "WebAssembly" in text
    page.close()


def test_switch_sends_the_same_conversation_to_the_server(site, dist, tmp_path):
    """The page served by a real `ruvllm serve` (torch, paged KV): the same prompt, greedy, gives the
    same reply on the server as in the browser."""
    from tests.server.server_harness import running_server

    _, context, _ = site
    hf = dist.parent / "llama"  # the torch checkpoint the page's llama export came from
    with running_server(hf, "--web-dir", str(dist), "--max-concurrent", "2", log_dir=tmp_path) as server:
        replies = {}
        for target in ("server", "browser"):
            page = _open(context, f"{server.url}/", "llama")
            assert page.evaluate("crossOriginIsolated") is True  # the server sends COOP/COEP too
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "24")
            page.select_option("#target", target)
            run = _send(page, "To be, or not to be?")
            assert run["target"] == target and run["finish"] in ("stop", "length"), page.inner_text("#error")
            replies[target] = run["text"]
            page.close()
    assert replies["server"] == replies["browser"] and replies["server"]


def test_no_request_leaves_loopback(site):
    base, _, requests = site
    assert requests, "no request was recorded"
    outside = [u for u in requests if not u.startswith(("http://127.0.0.1:", "data:", "blob:"))]
    assert outside == []
