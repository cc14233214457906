"""The page on a first visit, as a new user meets it (headless Chromium at 1280x900, the page's own menu).

With several models built and no `?model=` in the URL the page waits for the user
to pick one (it loaded the first before the user could choose SmolLM2); the
metrics line stays on screen while five files download; loading another model
clears the previous load time; the status says the files are downloading while
they are; and no request goes to a /favicon.ico the page does not have.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")
pytest.importorskip("playwright")

from tests.web.web_harness import browser, require_page, static_server, tiny_page  # noqa: E402

LOAD_TIMEOUT_MS = 180_000
VIEWPORT = {"width": 1280, "height": 900}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    require_page()
    return tiny_page(tmp_path_factory.mktemp("web-first"), builtin=False)


def test_a_first_visit_waits_for_the_choice_and_keeps_the_metrics_in_view(dist, tmp_path):
    with static_server(dist) as base, browser(tmp_path / "profile") as (context, requests):
        page = context.new_page()
        page.set_viewport_size(VIEWPORT)
        page.add_init_script("""window.statuses = [];
            setInterval(() => { const s = document.body?.dataset.status; if (s && s !== window.statuses.at(-1))
              window.statuses.push(s); }, 20);""")
        slow = {"done": False}

        def slow_weights(route):  # the first model file takes a second: what does the status say meanwhile?
            if not slow["done"]:
                slow["done"] = True
                time.sleep(1.0)
            route.continue_()

        page.route("**/*.onnx*", slow_weights)
        page.goto(base)
        page.wait_for_function("document.querySelectorAll('#model option').length >= 2")
        page.wait_for_timeout(1500)
        assert page.evaluate("document.body.dataset.status") == "choose a model"
        assert page.evaluate("window.ruvllmDemo.loads") == 0  # nothing loaded behind the user's back

        page.select_option("#model", index=1)
        page.click("#load")
        page.wait_for_function("document.body.dataset.status === 'ready'", timeout=LOAD_TIMEOUT_MS)
        assert "downloading" in page.evaluate("window.statuses"), page.evaluate("window.statuses")
        first = page.inner_text("#loadtime")
        assert first.endswith(" s")
        box = page.locator("#metrics").bounding_box()
        assert box is not None and box["y"] + box["height"] <= VIEWPORT["height"], box

        page.select_option("#model", index=0)
        page.click("#load")
        assert page.inner_text("#loadtime") == "-"  # not the previous model's figure while this one loads
        # the status may still read the first load's 'ready' for a moment after the click: wait for the second load
        page.wait_for_function("window.ruvllmDemo.loads >= 2 && document.body.dataset.status === 'ready'",
                               timeout=LOAD_TIMEOUT_MS)
        assert page.evaluate("window.ruvllmDemo.loads") == 2
        assert not [url for url in requests if url.endswith("/favicon.ico")]
