"""The hostile probe, long version: `ruvllm serve` against a client that means harm, measured.

    .venv/bin/python scripts/hostile_probe.py [--rounds 3] [--storms 3] [--storm-streams 64] [--uploads 100]
                                              [--grammar-storm 6] [--only grammars,grammar_storm,lora,feedback]

Against one server (the built-in model with hostile named chat templates, an API key, a web dir with
dotfiles), in phases:

  requests   every case of tests/server/hostile_requests.py, --rounds times (73 x 3 = 219), each followed by
             /health and a normal completion
  stops      the largest stop strings the API takes (64 x 1024 chars, n=8), and refused 30,000-char ones
  templates  six spinning templates at once while a completion is timed
  uploads    --uploads connections stalled just short of 4 MiB
  storms     --storms disconnect storms of --storm-streams streams each; KV blocks in use after each
  grammars   every hostile grammar of GRAMMAR_CASES once (status, param, seconds, CPU seconds of the server
             and its compile workers), then again (remembered), RSS of the server and its workers
  grammar_storm  --grammar-storm hostile grammars at once; a cached guided_choice, a new grammar from another
             client and a plain completion timed during it and on the idle server
  sigterm    SIGTERM under load: what new connections get while it drains, the exit status, the drain time
then servers for runtime LoRA loading (hostile adapter folders) and feedback ownership
(tests/server/hostile_probe_phases.py), a second server whose forward pass fails (it must exit 1), and the broken model folders of
tests/models/broken_models.py through `ruvllm generate` (one `error:` line naming the file each).

Prints a table and writes JSON (default benchmarks/results/hostile_probe.json) with the counts of
5xx (the 503s new requests get while the server drains are expected, and counted apart) and of
unexpected statuses, leaked blocks, RSS growth, and the machine's load. Exits 1 unless all is clean.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.models.broken_models import BROKEN, broken_model  # noqa: E402
from tests.server.hostile_requests import (BUILTIN, CASES, FAULTY_FORWARD, OK_COMPLETION, USER, error_shape,  # noqa: E402
                              hostile_model, open_and_drop, send, stalled_upload, web_dir_with_dotfiles)
from tests.server.server_harness import API_KEY, metric, rss_mb, running_server, wait_until  # noqa: E402
from tests.server import hostile_probe_phases as new_phases  # noqa: E402

AUTH = {"Authorization": f"Bearer {API_KEY}"}


class Tally:
    """Statuses seen, 5xx among them, and what did not go as expected."""

    def __init__(self) -> None:
        self.statuses: Counter[int] = Counter()
        self.unexpected: list[str] = []

    def saw(self, status: int, expected: set[int] | int, what: str) -> None:
        self.statuses[status] += 1
        expected = {expected} if isinstance(expected, int) else expected
        if status not in expected:
            self.unexpected.append(f"{what}: {status} (expected {sorted(expected)})")

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


def still_serving(http: httpx.Client, tally: Tally, what: str) -> None:
    tally.saw(http.get("/health").status_code, 200, f"/health after {what}")
    tally.saw(http.post("/v1/completions", json=OK_COMPLETION, headers=AUTH).status_code, 200, f"normal after {what}")


def phase_requests(http: httpx.Client, rounds: int, tally: Tally) -> dict[str, Any]:
    shapes_bad = 0
    for _ in range(rounds):
        for case in CASES:
            response = send(http, case, API_KEY)
            tally.saw(response.status_code, case.status, case.name)
            try:
                error_shape(response)
            except (AssertionError, KeyError, ValueError):
                shapes_bad += 1
                tally.unexpected.append(f"{case.name}: not an OpenAI-shaped error: {response.text[:200]}")
            still_serving(http, tally, case.name)
    return {"hostile_requests": rounds * len(CASES), "cases": len(CASES), "bad_error_shapes": shapes_bad}


def phase_stops(http: httpx.Client, tally: Tally) -> dict[str, Any]:
    largest = {"prompt": "ROMEO:", "max_tokens": 8, "n": 8, "temperature": 1, "stop": ["q" * 1024] * 64}
    for _ in range(20):
        tally.saw(http.post("/v1/completions", json=largest, headers=AUTH).status_code, 200, "largest stops")
        refused = {**largest, "stop": ["q" * 30000], "n": 4, "max_tokens": 2}
        tally.saw(http.post("/v1/completions", json=refused, headers=AUTH).status_code, 400, "30,000-char stop")
    return {"stop_requests": 40}


def phase_templates(server_url: str, tally: Tally) -> dict[str, Any]:
    body = {"messages": USER, "max_tokens": 2, "chat_template_kwargs": {"chat_template": "spin"}}
    statuses: list[int] = []
    threads = [threading.Thread(target=lambda: statuses.append(httpx.post(
        f"{server_url}/v1/chat/completions", json=body, headers=AUTH, timeout=120).status_code)) for _ in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    started = time.monotonic()
    ok = httpx.post(f"{server_url}/v1/completions", json=OK_COMPLETION, headers=AUTH, timeout=60)
    latency = time.monotonic() - started
    for thread in threads:
        thread.join()
    for status in statuses:
        tally.saw(status, 400, "spinning template")
    tally.saw(ok.status_code, 200, "completion beside spinning templates")
    return {"spinning_templates": 6, "completion_latency_beside_them_s": round(latency, 3)}


def phase_uploads(port: int, count: int, tally: Tally) -> dict[str, Any]:
    statuses: list[str] = []
    threads = [threading.Thread(target=stalled_upload, args=(port, 4_000_000, API_KEY, statuses)) for _ in range(count)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    codes = Counter(s.split(" ")[1] if s.startswith("HTTP/1.1 ") else s for s in statuses)
    for code, n in codes.items():
        for _ in range(n):
            tally.saw(int(code) if code.isdigit() else 0, {408, 429}, "stalled upload")
    return {"stalled_uploads": count, "upload_statuses": dict(codes), "uploads_s": round(time.monotonic() - started, 1)}


def wait_idle(server: Any, timeout: float = 60.0) -> dict[str, float]:
    """The metrics once nothing runs, waits or holds a block; or, after `timeout`, as they are (leaks show)."""
    busy = ("kv_cache_blocks_used", "num_requests_running", "num_requests_waiting")
    try:
        return wait_until(server, lambda m: [metric(m, k) for k in busy] == [0, 0, 0], timeout)
    except AssertionError:
        return server.metrics()


def phase_storms(server: Any, storms: int, streams: int, tally: Tally) -> dict[str, Any]:
    body = {"prompt": "ROMEO:", "max_tokens": 200, "ignore_eos": True, "temperature": 1, "stream": True, "n": 2}
    leaked = []
    for _ in range(storms):
        done: list[bool] = []
        threads = [threading.Thread(target=open_and_drop, args=(f"{server.url}/v1/completions", body, API_KEY,
                                                                done)) for _ in range(streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        metrics = wait_idle(server)
        leaked.append(int(metric(metrics, "kv_cache_blocks_used")))
        for ok in done:
            tally.saw(200 if ok else 0, 200, "storm stream")
    return {"storms": storms, "streams_per_storm": streams, "kv_blocks_in_use_after_each": leaked}


def phase_sigterm(server: Any, tally: Tally) -> dict[str, Any]:
    body = {"prompt": "ROMEO:", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    ends: list[str] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
                lines = list(r.iter_lines())
                ends.append("done" if "data: [DONE]" in lines else "cut")
        except httpx.HTTPError:
            ends.append("cut")

    threads = [threading.Thread(target=stream) for _ in range(16)]
    for thread in threads:
        thread.start()
    wait_until(server, lambda m: metric(m, "num_requests_running") == 16, 60)
    server.process.send_signal(15)
    signalled = time.monotonic()
    during: Counter[str] = Counter()
    while server.process.poll() is None and time.monotonic() - signalled < 60:
        try:
            status = httpx.post(f"{server.url}/v1/completions", json=OK_COMPLETION, headers=AUTH, timeout=5).status_code
            during[str(status)] += 1
            tally.saw(status, 503, "new request while draining")
        except httpx.HTTPError:
            during["refused (closed after the drain)"] += 1
        time.sleep(0.1)
    code = server.process.wait(60)
    drain = time.monotonic() - signalled
    for thread in threads:
        thread.join(60)
    return {"sigterm_streams": len(threads), "sigterm_stream_ends": dict(Counter(ends)),
            "sigterm_new_requests": dict(during), "sigterm_exit_status": code, "sigterm_exit_s": round(drain, 2)}


def phase_fatal(log_dir: Path) -> dict[str, Any]:
    with running_server(BUILTIN, log_dir=log_dir, prelude=FAULTY_FORWARD) as srv:
        failed = httpx.post(f"{srv.url}/v1/completions", json={**OK_COMPLETION, "max_tokens": 50, "ignore_eos": True},
                            timeout=60)
        code = srv.process.wait(60)
    return {"fatal_forward_request_status": failed.status_code, "fatal_forward_exit_status": code}


def phase_broken_folders(root: Path) -> dict[str, Any]:
    good, bad = 0, []
    for name in sorted(BROKEN):
        folder = broken_model(root, name)
        result = subprocess.run([sys.executable, "-m", "ruvllm_cli", "generate", "--model", str(folder), "--device",
                                 "cpu", "--max-tokens", "1", "--temperature", "0", "ROMEO:"], cwd=REPO,
                                capture_output=True, text=True, timeout=300)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        if (result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error:")
                and BROKEN[name][1] in lines[0]):
            good += 1
        else:
            bad.append({"case": name, "status": result.returncode, "stderr": result.stderr[-500:]})
    return {"broken_folders": len(BROKEN), "broken_folders_one_error_line": good, "broken_folders_failed": bad}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--storms", type=int, default=3)
    parser.add_argument("--storm-streams", type=int, default=64)
    parser.add_argument("--uploads", type=int, default=100)
    parser.add_argument("--grammar-storm", type=int, default=6)
    parser.add_argument("--only", default=None, help="comma-separated phases (e.g. grammars,grammar_storm,lora,"
                                                    "feedback); default: all")
    parser.add_argument("--skip-broken-folders", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "hostile_probe.json")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hostile-probe-"))
    tally, report = Tally(), {}
    load_before = os.getloadavg()
    model = hostile_model(tmp / "tiny-shakespeare")
    web = web_dir_with_dotfiles(tmp / "web")
    started = time.monotonic()
    with running_server(model, "--api-key", API_KEY, "--web-dir", str(web), "--chat-template-timeout", "2",
                        "--request-body-timeout", "5", "--shutdown-timeout", "3", log_dir=tmp) as server:
        port = int(server.url.rsplit(":", 1)[1])
        with httpx.Client(base_url=server.url, timeout=120) as http:
            for _ in range(10):
                still_serving(http, tally, "warm-up")
            rss_start = rss_mb(server.process.pid)
            phases = [("requests", lambda: phase_requests(http, args.rounds, tally)),
                      ("grammars", lambda: new_phases.phase_grammars(server, http, tally)),
                      ("grammar_storm", lambda: new_phases.phase_grammar_storm(server, http, args.grammar_storm, tally)),
                      ("stops", lambda: phase_stops(http, tally)),
                      ("templates", lambda: phase_templates(server.url, tally)),
                      ("uploads", lambda: phase_uploads(port, args.uploads, tally)),
                      ("storms", lambda: phase_storms(server, args.storms, args.storm_streams, tally))]
            only = set(args.only.split(",")) if args.only else None
            rss = {"start": round(rss_start, 1)}
            for name, run in phases:
                if only is not None and name not in only:
                    continue
                print(f"[{time.monotonic() - started:6.1f}s] {name} ...", flush=True)
                report.update(run())
                rss[f"after_{name}"] = round(rss_mb(server.process.pid), 1)
                still_serving(http, tally, name)
            report["rss_mib"] = rss
            report["rss_growth_mib"] = round(max(rss.values()) - rss_start, 1)
        if only is None or "sigterm" in only:
            print(f"[{time.monotonic() - started:6.1f}s] sigterm ...", flush=True)
            draining = Tally()  # its 503s are the point: counted apart from the 5xx that must not happen
            report.update(phase_sigterm(server, draining))
            tally.unexpected += draining.unexpected
        log = server.log()
    report["server_log_tracebacks"] = log.count("Traceback (most recent call last)")
    for name, run in (("lora", lambda: new_phases.phase_lora(tmp / "lora", tally)),
                      ("feedback", lambda: new_phases.phase_feedback(tmp / "feedback", tally))):
        if only is None or name in only:
            print(f"[{time.monotonic() - started:6.1f}s] {name} ...", flush=True)
            report.update(run())
    if only is None or "fatal" in only:
        print(f"[{time.monotonic() - started:6.1f}s] fatal forward ...", flush=True)
        report.update(phase_fatal(tmp))
    if not args.skip_broken_folders and (only is None or "broken" in only):
        print(f"[{time.monotonic() - started:6.1f}s] broken folders ...", flush=True)
        report.update(phase_broken_folders(tmp / "broken"))
    report.update({"responses_5xx": tally.server_errors, "statuses": dict(sorted(tally.statuses.items())),
                   "unexpected": tally.unexpected, "seconds": round(time.monotonic() - started, 1),
                   "load_before": load_before, "load_after": os.getloadavg(),
                   "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                               "python": platform.python_version()}})
    _print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    expected_fatal = report.get("fatal_forward_exit_status", 1) == 1
    clean = (not tally.unexpected and report.get("sigterm_exit_status", 0) == 0 and expected_fatal
             and not any(report.get("kv_blocks_in_use_after_each", [])) and report["rss_growth_mib"] < 300
             and not report.get("broken_folders_failed"))
    return 0 if clean else 1


def _print_table(report: dict[str, Any]) -> None:
    rows = [
        ("hostile requests", f"{report.get('hostile_requests', '-')} ({report.get('cases', '-')} cases)"),
        ("responses 5xx (all but the drain's 503s)", report["responses_5xx"]),
        ("unexpected statuses", len(report["unexpected"])),
        ("stalled uploads", f"{report.get('stalled_uploads', '-')}: {report.get('upload_statuses', '-')}"),
        ("completion beside 6 spinning templates", f"{report.get('completion_latency_beside_them_s', '-')} s"),
        ("KV blocks in use after each storm", report.get("kv_blocks_in_use_after_each", "-")),
        ("RSS start / growth (MiB)", f"{report['rss_mib']['start']} / {report['rss_growth_mib']}"),
        ("SIGTERM: new requests while draining", report.get("sigterm_new_requests", "-")),
        ("SIGTERM: exit status, seconds", f"{report.get('sigterm_exit_status', '-')}, {report.get('sigterm_exit_s', '-')}"),
        ("failed forward: exit status", report.get("fatal_forward_exit_status", "-")),
        ("broken folders with one error line", f"{report.get('broken_folders_one_error_line', '-')} / "
                                               f"{report.get('broken_folders', '-')}"),
        ("tracebacks in the server log", report["server_log_tracebacks"]),
    ]
    if "grammar_rss_mib" in report:
        g = report["grammar_rss_mib"]
        rows += [("grammar cases again (remembered), s", report["grammar_cases_again_s"]),
                 ("RSS server/workers before -> after grammars", f"{g['before']} -> {g['after']}")]
    if "storm_statuses" in report:
        rows += [(f"grammar storm ({report['storm_grammars']}): statuses, last 400, CPU s",
                  f"{report['storm_statuses']}, {report['storm_last_400_s']} s, {report['storm_cpu_seconds']}"),
                 ("normal requests idle (s)", report["normal_idle_s"]),
                 ("normal requests during the storm (s)", report["normal_during_storm_s"]),
                 ("RSS server/workers before -> after storm", f"{report['storm_rss_mib']['before']} -> "
                                                              f"{report['storm_rss_mib']['after']}")]
    if "feedback_statuses" in report:
        rows.append(("feedback on alice's completion as", report["feedback_statuses"]))
    width = max(len(r[0]) for r in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    for table in ("grammar_cases", "lora_cases"):
        if table in report:
            print(f"\n{'case':<42} {'status':>6} {'s':>7} {'CPU s':>6}  message")
            for r in report[table]:
                print(f"{r['case']:<42} {r['status']:>6} {r['seconds']:>7} {r.get('cpu_seconds', ''):>6}  "
                      f"{r['message'][:70]}")
    for line in report["unexpected"][:20]:
        print("  unexpected:", line)


if __name__ == "__main__":
    sys.exit(main())
