"""`ruvllm serve` against a hostile client: one request must never kill, stall or bloat the server.

Every request of tests/hostile_requests.py gets its 4xx with an OpenAI-shaped body, and afterwards
/health is 200 and a normal request succeeds. Memory: stop strings, chat templates (the model's own
hostile ones: client templates are off) and a hundred stalled uploads leave the server's RSS within a
bound. A storm of disconnects leaves no KV block in use. A second server (client templates allowed)
shows a spinning template does not stall completions, then takes SIGTERM under load: new connections
get a 503 while it drains, and it exits 0. A third, whose forward pass fails, reports it on /health and
exits 1. Grammars (structured outputs, tools, response_format): each hostile one gets its 400 after
little CPU time (the server's and its compile workers'), and while a storm of them compiles, a cached
guided_choice, a new small grammar from another client and a plain completion answer about as fast as
on an idle server, and the server's memory comes back. The long version, repeated and measured, is
scripts/hostile_probe.py.
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.hostile_requests import (ANY, BUILTIN, CASES, FAULTY_FORWARD, GRAMMAR_CASES, NORMAL_CHOICE,
                                          OK_COMPLETION, USER, error_shape, grammar_workers, hostile_model,
                                          open_and_drop, send,
                                          stalled_upload, storm_body, tree_cpu_seconds, tree_rss_mb,
                                          web_dir_with_dotfiles)
from tests.server.server_harness import API_KEY, Server, metric, no_traceback, rss_mb, running_server, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEMPLATE_TIMEOUT = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return hostile_model(tmp_path_factory.mktemp("hostile") / "tiny-shakespeare")


@pytest.fixture(scope="module")
def web_dir(tmp_path_factory) -> Path:
    return web_dir_with_dotfiles(tmp_path_factory.mktemp("web"))


@pytest.fixture(scope="module")
def server(model_dir, web_dir, tmp_path_factory):
    with running_server(model_dir, "--api-key", API_KEY, "--web-dir", str(web_dir), "--chat-template-timeout",
                        str(TEMPLATE_TIMEOUT), "--request-body-timeout", "3",
                        log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv
        log = srv.log()
        assert no_traceback(log) and " 500 " not in log, log[-3000:]


@pytest.fixture(scope="module")
def http(server: Server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def assert_still_serving(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    ok = http.post("/v1/completions", json=OK_COMPLETION, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop"), ok.text


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_request_gets_its_4xx_and_the_server_goes_on(http, case):
    response = send(http, case, API_KEY)
    assert response.status_code == case.status, (case.name, response.text[:500])
    error = error_shape(response)
    if case.path.startswith("/v1/messages"):  # Anthropic's API, Anthropic's error shape
        assert response.json()["type"] == "error", (case.name, response.text[:500])
    if case.param is not ANY:
        assert error["param"] == case.param, (case.name, error)
    assert len(error["message"]) < 1000  # a 5,000-digit key is not echoed back
    assert_still_serving(http)


GRAMMAR_CPU_SECONDS = 4.0  # the issue asks 2 s of compute; twice that for a machine shared with other work
GRAMMAR_WALL_SECONDS = 60.0  # the wall clock of a machine loaded tenfold; the CPU bound is the real one
STORM_EXTRA_SECONDS = 1.0  # above idle, for a normal request during a storm (the bound) ...


def storm_extra_seconds() -> float:
    """... stretched by how oversubscribed the machine is (other work's load: a 2-core machine at load 16
    gives this server an eighth of what the bound assumes); scripts/hostile_probe.py reports the raw times."""
    return STORM_EXTRA_SECONDS * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


@pytest.mark.parametrize("case", GRAMMAR_CASES, ids=[c.name for c in GRAMMAR_CASES])
def test_hostile_grammar_gets_its_400_after_little_compute(server, http, case):
    """Once 27-107 s and 1.2 GB; now a size bound in the compile worker trips within a fraction of that."""
    before_cpu, started = tree_cpu_seconds(server.process.pid), time.monotonic()
    response = send(http, case, API_KEY)
    wall, cpu = time.monotonic() - started, tree_cpu_seconds(server.process.pid) - before_cpu
    assert response.status_code == case.status, (case.name, response.text[:500])
    assert error_shape(response)["param"] == case.param, response.text[:500]
    assert cpu < GRAMMAR_CPU_SECONDS and wall < GRAMMAR_WALL_SECONDS, f"{case.name}: {cpu:.1f} s CPU, {wall:.1f} s"


def _latency(http: httpx.Client, body: dict, rounds: int = 3) -> float:
    times = []
    for _ in range(rounds):
        started = time.monotonic()
        response = http.post("/v1/completions", json=body, headers=AUTH)
        times.append(time.monotonic() - started)
        assert response.status_code == 200, response.text
    return max(times)


def test_a_grammar_storm_stalls_nobody_and_leaves_no_memory(server, http):
    """Two slow compiles once made a cached guided_choice wait 57-76 s and a plain completion 12.7 s."""
    for body in (NORMAL_CHOICE, OK_COMPLETION):
        _latency(http, body, 2)  # warm: the choice is cached from here on
    idle = {"choice": _latency(http, NORMAL_CHOICE), "plain": _latency(http, OK_COMPLETION)}
    idle["new"] = _latency(http, {**NORMAL_CHOICE, "guided_choice": ["ay", "nay"], "user": "alice"}, 1)
    rss_before = tree_rss_mb(server.process.pid)[0]
    statuses: list[int] = []
    bodies = [json.dumps(storm_body(i)).encode() for i in range(6)]  # made first: not this process's GIL time
    storm = [threading.Thread(target=lambda b=b: statuses.append(httpx.post(
        f"{server.url}/v1/completions", content=b, headers={**AUTH, "content-type": "application/json"},
        timeout=300).status_code)) for b in bodies]
    for thread in storm:
        thread.start()
    time.sleep(0.5)
    busy = {"choice": _latency(http, NORMAL_CHOICE), "plain": _latency(http, OK_COMPLETION),
            "new": _latency(http, {**NORMAL_CHOICE, "guided_choice": ["oui", "non"], "user": "alice"}, 1)}
    for thread in storm:
        thread.join(300)
    assert statuses == [400] * 6
    bound = storm_extra_seconds()
    slow = {k: round(busy[k] - idle[k], 2) for k in busy if busy[k] > idle[k] + bound}
    assert not slow, f"slower during the storm by {slow} s, more than {bound:.1f} s (idle {idle}, storm {busy})"
    growth = tree_rss_mb(server.process.pid)[0] - rss_before
    assert growth < 100, f"the server's RSS grew {growth:.0f} MiB over the storm"
    workers = tree_rss_mb(server.process.pid)[1]
    assert workers < 1024, f"the server's workers hold {workers:.0f} MiB"
    assert_still_serving(http)


def test_a_killed_grammar_worker_costs_one_request_and_the_server_goes_on(server, http):
    """Workers killed from outside (an operator, the OOM killer) cost no request: a compile that finds
    its worker dead (idle ones look alive until the loop reaps them; before the retry one in three
    such requests got a 400) or loses it midway runs again on a fresh one, and everything else goes on."""
    pid = server.process.pid
    assert http.post("/v1/completions", json=NORMAL_CHOICE, headers=AUTH).status_code == 200  # cached from here
    for worker in grammar_workers(pid):
        os.kill(worker, signal.SIGKILL)
    fresh = {**NORMAL_CHOICE, "guided_choice": ["killed", "idle"]}
    assert http.post("/v1/completions", json=fresh, headers=AUTH).status_code == 200
    replies: list[httpx.Response] = []
    slow = {**OK_COMPLETION, "guided_regex": "(a|b|c)*a(a|b|c){15}"}  # ~1-3 s of compile to 50,000 DFA states
    thread = threading.Thread(target=lambda: replies.append(http.post("/v1/completions", json=slow, headers=AUTH)))
    thread.start()
    busy, deadline = None, time.monotonic() + 30
    while busy is None and thread.is_alive() and time.monotonic() < deadline:
        before = grammar_workers(pid)
        time.sleep(0.1)
        busy = next((w for w, cpu in grammar_workers(pid).items() if cpu > before.get(w, cpu)), None)
    assert busy is not None, "no worker was seen compiling"
    os.kill(busy, signal.SIGKILL)
    thread.join(60)
    # the job is tried once more on a fresh worker (the one killed might have died idle): the regex's own 400
    assert replies[0].status_code == 400 and "DFA states" in error_shape(replies[0])["message"], replies[0].text
    assert busy not in grammar_workers(pid)
    started = time.monotonic()
    assert http.post("/v1/completions", json=NORMAL_CHOICE, headers=AUTH).status_code == 200
    assert time.monotonic() - started < 10
    assert http.post("/v1/completions", json={**fresh, "guided_choice": ["killed", "busy"]},
                     headers=AUTH).status_code == 200
    assert_still_serving(http)


def test_the_probes_first_finding_stays_fixed(http):
    """top_k 2**63 once overflowed the batched sampler on the engine thread: the engine died for good."""
    for _ in range(3):
        assert http.post("/v1/completions", json={"prompt": "ROMEO:", "top_k": 2**63, "temperature": 1},
                         headers=AUTH).status_code == 400
    assert http.get("/health").status_code == 200
    big_but_valid = {"prompt": "ROMEO:", "top_k": 4096, "temperature": 1, "max_tokens": 3, "seed": 2**63 - 1}
    assert http.post("/v1/completions", json=big_but_valid, headers=AUTH).status_code == 200


def test_null_max_tokens_is_openais_16(http):
    body = {"prompt": "ROMEO:", "max_tokens": None, "ignore_eos": True, "temperature": 0}
    usage = http.post("/v1/completions", json=body, headers=AUTH).json()["usage"]
    assert usage["completion_tokens"] == 16


def test_models_and_schema(http, model_dir):
    models = http.get("/v1/models", headers=AUTH)
    assert models.status_code == 200 and str(model_dir) not in models.text
    assert models.json()["data"][0]["root"] == models.json()["data"][0]["id"] == "tiny-shakespeare"
    assert http.get("/openapi.json", headers=AUTH).json()["info"]["title"] == "ruvllm"
    assert http.get("/docs", headers=AUTH).status_code == 200
    assert http.get("/", headers={"host": "localhost"}).text == "<p>demo</p>"
    assert http.get("/health", headers={"host": "[::1]:1"}).status_code == 200


def test_memory_stays_bounded_under_stop_strings_and_templates(server, http):
    before = rss_mb(server.process.pid)
    longest = {"prompt": "ROMEO:", "max_tokens": 4, "n": 8, "temperature": 1, "stop": ["q" * 1024] * 64}
    for _ in range(8):  # the largest stops the API takes, 8 samples each
        assert http.post("/v1/completions", json=longest, headers=AUTH).status_code == 200
        assert http.post("/v1/completions", json={**longest, "stop": ["q" * 30000]}, headers=AUTH).status_code == 400
    for name in ("bomb", "flood"):
        body = {"messages": USER, "max_tokens": 2, "chat_template_kwargs": {"chat_template": name}}
        assert http.post("/v1/chat/completions", json=body, headers=AUTH).status_code == 400
    growth = rss_mb(server.process.pid) - before
    assert growth < 150, f"RSS grew {growth:.0f} MiB"
    assert_still_serving(http)


def teststalled_uploads_time_out_and_leave_no_memory_behind(server, http):
    """A hundred connections stalled just short of 4 MiB once held 344 MiB for good."""
    before = rss_mb(server.process.pid)
    statuses: list[str] = []
    port = int(server.url.rsplit(":", 1)[1])
    threads = [threading.Thread(target=stalled_upload, args=(port, 4_000_000, API_KEY, statuses)) for _ in range(100)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    codes = {s.split(" ")[1] if s.startswith("HTTP/1.1 ") else s for s in statuses}
    assert codes <= {"408", "429"} and len(statuses) == 100, statuses  # deadline, or the shared budget
    assert "408" in codes and "429" in codes
    growth = rss_mb(server.process.pid) - before
    assert growth < 150, f"RSS grew {growth:.0f} MiB after the uploads closed"
    assert_still_serving(http)


def test_a_disconnect_storm_leaves_no_kv_block_in_use(server, http):
    body = {"prompt": "ROMEO:", "max_tokens": 200, "ignore_eos": True, "temperature": 1, "stream": True, "n": 2}
    done: list[bool] = []
    threads = [threading.Thread(target=open_and_drop, args=(f"{server.url}/v1/completions", body, API_KEY, done))
               for _ in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(done) == 64
    busy = ("kv_cache_blocks_used", "num_requests_running", "num_requests_waiting")
    wait_until(server, lambda m: [metric(m, k) for k in busy] == [0, 0, 0])
    assert_still_serving(http)


# --- a server that runs clients' templates, then drains under load ------------------------------------
@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    with running_server(BUILTIN, "--allow-client-chat-template", "--chat-template-timeout", str(TEMPLATE_TIMEOUT),
                        "--shutdown-timeout", "3", log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv


def test_client_templates_run_bounded_and_never_stall_completions(open_server):
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    body = {"messages": USER, "max_tokens": 2, "chat_template_kwargs": {"chat_template": spin}}
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(
        httpx.post(f"{open_server.url}/v1/chat/completions", json=body, timeout=60))) for _ in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    started = time.monotonic()
    completion = httpx.post(f"{open_server.url}/v1/completions", json=OK_COMPLETION, timeout=60)
    latency = time.monotonic() - started
    for thread in threads:
        thread.join(60)
    assert completion.status_code == 200
    assert latency < TEMPLATE_TIMEOUT, f"a completion waited {latency:.1f} s behind spinning templates"
    assert [r.status_code for r in results] == [400] * 6
    # each one overran its own deadline, or found both workers busy spinning until its deadline
    assert all(re.search("longer than|no template worker was free", r.json()["error"]["message"]) for r in results)
    mine = {"messages": USER, "max_tokens": 2, "chat_template_kwargs": {"chat_template": "{{ messages[0].content }}"}}
    assert httpx.post(f"{open_server.url}/v1/chat/completions", json=mine, timeout=60).json()["usage"][
        "prompt_tokens"] > 0


def test_sigterm_under_load_answers_503_while_draining_then_exits_0(open_server):
    body = {"prompt": "ROMEO:", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    done: list[bool] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", f"{open_server.url}/v1/completions", json=body, timeout=60) as response:
                done.append(response.status_code == 200 and any(l == "data: [DONE]" for l in response.iter_lines()))
        except httpx.HTTPError:
            done.append(False)

    threads = [threading.Thread(target=stream) for _ in range(8)]
    for thread in threads:
        thread.start()
    wait_until(open_server, lambda m: metric(m, "num_requests_running") == 8)
    open_server.process.send_signal(15)
    time.sleep(0.3)
    refused = httpx.post(f"{open_server.url}/v1/completions", json=OK_COMPLETION, timeout=10)  # a new connection
    assert refused.status_code == 503 and error_shape(refused)["type"] == "service_unavailable"
    assert httpx.get(f"{open_server.url}/health", timeout=10).status_code == 503
    assert open_server.process.wait(30) == 0
    for thread in threads:
        thread.join(30)
    assert len(done) == 8  # every stream ended: with its text, or an error event when the drain cut it
    assert no_traceback(open_server.log())


# --- a server whose forward pass fails ----------------------------------------------------------------
def test_a_failed_forward_pass_is_fatal_and_exits_1(tmp_path):
    with running_server(BUILTIN, log_dir=tmp_path, prelude=FAULTY_FORWARD) as srv:
        failed = httpx.post(f"{srv.url}/v1/completions", json={**OK_COMPLETION, "max_tokens": 50, "ignore_eos": True},
                            timeout=60)
        assert failed.status_code in (500, 503) and "device lost" in error_shape(failed)["message"]
        assert srv.process.wait(30) == 1
        log = srv.log()
        assert "exiting with status 1" in log and "device lost" in log
