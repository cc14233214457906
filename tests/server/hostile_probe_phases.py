"""scripts/hostile_probe.py's phases for the surfaces of issue 28: grammars, a grammar storm, runtime LoRA
loading, feedback ownership. Each returns a dict for the report, with times (wall, and CPU of the server and
its workers) and memory (the server's RSS, its workers' RSS), and records what went unexpectedly in `tally`.

    grammars       every GRAMMAR_CASES body once (its 400, param, seconds, CPU seconds), then all again
                   (remembered: no compile), and the RSS before/after
    grammar_storm  `storm` distinct hostile grammars at once while a cached guided_choice, a new grammar
                   from another client and a plain completion are timed, against the same on the idle server
    lora           a second server with --enable-runtime-lora: each hostile adapter folder (links out of
                   --lora-dir, NaN weights, a target module the model lacks) gets its 400 naming what is wrong
    feedback       a third server with --witness-log: another session's feedback is a 403, the owner's a 200
"""
from __future__ import annotations

import json
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.server.hostile_requests import (BUILTIN, GRAMMAR_CASES, NORMAL_CHOICE, OK_COMPLETION, error_shape, send,
                                          storm_body, tree_cpu_seconds, tree_rss_mb)
from tests.server.server_harness import API_KEY, running_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _rss(pid: int) -> dict[str, float]:
    own, workers = tree_rss_mb(pid)
    return {"server": round(own, 1), "workers": round(workers, 1)}


def phase_grammars(server: Any, http: httpx.Client, tally: Any) -> dict[str, Any]:
    pid, rows = server.process.pid, []
    before = _rss(pid)
    for case in GRAMMAR_CASES:
        cpu, started = tree_cpu_seconds(pid), time.monotonic()
        try:
            response = send(http, case, API_KEY)
        except httpx.TimeoutException:  # a server that compiles on and on (before issue 28: the allOf loop)
            response = httpx.Response(599, text=f"no answer within {http.timeout.read} s")
        wall, cpu = time.monotonic() - started, tree_cpu_seconds(pid) - cpu
        tally.saw(response.status_code, case.status, case.name)
        try:
            error = error_shape(response)
        except (AssertionError, KeyError, ValueError):
            error = {"param": None, "message": response.text[:200]}
        if error["param"] != case.param:
            tally.unexpected.append(f"{case.name}: param {error['param']!r} (expected {case.param!r})")
        rows.append({"case": case.name, "status": response.status_code, "param": error["param"],
                     "seconds": round(wall, 2), "cpu_seconds": round(cpu, 2), "message": error["message"][:90]})
    started = time.monotonic()
    for case in GRAMMAR_CASES:  # the same again: remembered failures, no compile
        try:
            tally.saw(send(http, case, API_KEY).status_code, case.status, f"{case.name} (again)")
        except httpx.TimeoutException:
            tally.saw(599, case.status, f"{case.name} (again)")
    again = time.monotonic() - started
    return {"grammar_cases": rows, "grammar_cases_again_s": round(again, 2),
            "grammar_rss_mib": {"before": before, "after": _rss(pid)}}


def _latency(http: httpx.Client, body: dict, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.monotonic()
        status = http.post("/v1/completions", json=body, headers=AUTH).status_code
        times.append(time.monotonic() - started if status == 200 else float("inf"))
    return round(statistics.median(times), 3)


def _normal(http: httpx.Client, tag: str, rounds: int = 3) -> dict[str, float]:
    return {"cached_choice": _latency(http, NORMAL_CHOICE, rounds), "plain": _latency(http, OK_COMPLETION, rounds),
            "new_grammar_other_client": _latency(http, {**NORMAL_CHOICE, "guided_choice": [f"{tag}-a", f"{tag}-b"],
                                                         "user": "alice"}, 1)}


def phase_grammar_storm(server: Any, http: httpx.Client, storm: int, tally: Any) -> dict[str, Any]:
    pid = server.process.pid
    _normal(http, "warm", 2)
    idle = _normal(http, "idle")
    bodies = [json.dumps(storm_body(1000 + i)).encode() for i in range(storm)]  # made before the clock starts
    rss_before, cpu_before, statuses, ends = _rss(pid), tree_cpu_seconds(pid), [], []
    started = time.monotonic()

    def post(body: bytes) -> None:
        try:
            statuses.append(httpx.post(f"{server.url}/v1/completions", content=body, timeout=600,
                                       headers={**AUTH, "content-type": "application/json"}).status_code)
        except httpx.TimeoutException:
            statuses.append(599)
        ends.append(time.monotonic() - started)

    threads = [threading.Thread(target=post, args=(b,)) for b in bodies]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    busy = _normal(http, "storm")
    for thread in threads:
        thread.join()
    for status in statuses:
        tally.saw(status, 400, "storm grammar")
    return {"storm_grammars": storm, "storm_statuses": sorted(statuses), "storm_last_400_s": round(max(ends), 2),
            "storm_cpu_seconds": round(tree_cpu_seconds(pid) - cpu_before, 2), "normal_idle_s": idle,
            "normal_during_storm_s": busy, "storm_rss_mib": {"before": rss_before, "after": _rss(pid)}}


def phase_lora(root: Path, tally: Any) -> dict[str, Any]:
    from tests.server.lora_adapters import build_adapters, hostile_adapters

    lora_dir, outside = root / "loras", root / "outside"
    outside.mkdir(parents=True)
    lora_dir.mkdir()
    build_adapters(lora_dir)
    cases = hostile_adapters(lora_dir, "qv", outside)
    rows = []
    with running_server(BUILTIN, "--enable-runtime-lora", "--lora-dir", str(lora_dir), log_dir=root) as srv:
        for name, (folder, words) in cases.items():
            started = time.monotonic()
            r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": folder},
                           timeout=120)
            message = r.json().get("error", {}).get("message", r.text) if r.status_code != 200 else r.text
            tally.saw(r.status_code, 400, f"lora {name}")
            if words not in message:
                tally.unexpected.append(f"lora {name}: {message[:200]!r} lacks {words!r}")
            rows.append({"case": name, "status": r.status_code, "seconds": round(time.monotonic() - started, 2),
                         "message": message[:100]})
        ok = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": "qv"}, timeout=120)
        tally.saw(ok.status_code, 200, "lora qv (a good one)")
        rss = _rss(srv.process.pid)
    shutil.rmtree(lora_dir, ignore_errors=True)
    return {"lora_cases": rows, "lora_rss_mib": rss}


def phase_feedback(root: Path, tally: Any) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    with running_server(BUILTIN, "--witness-log", str(root / "witness"), log_dir=root) as srv:
        reply = httpx.post(f"{srv.url}/v1/completions", json={**OK_COMPLETION, "user": "alice"}, timeout=60).json()
        deadline = time.monotonic() + 30
        rows = {}
        for who in ("mallory", None, "alice"):
            body = {"id": reply["id"], "rating": 1, **({"user": who} if who else {})}  # (alice's last)
            while True:  # the log writes from its own thread: the id may take a moment to be known
                r = httpx.post(f"{srv.url}/v1/feedback", json=body, timeout=30)
                if r.status_code != 404 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            rows[who or "no user"] = r.status_code
            tally.saw(r.status_code, 200 if who == "alice" else 403, f"feedback as {who}")
    return {"feedback_statuses": rows}
