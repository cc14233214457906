"""Two replicas of the built-in model on a local Ray Serve cluster, through the official openai client.

- 32 concurrent streams complete with the one-process LLM's greedy tokens, spread over both replicas;
- the same conversation (its `user`, or without one its prompt prefix) lands on one replica, as the
  x-ruvllm-replica / x-ruvllm-route headers and the router's metrics show; /metrics sums the replicas';
- a replica's process killed under load: every request that had not started streaming completes with its greedy
  text (sent once more, to the other replica), the ones that had started end with an OpenAI error event,
  and Serve brings the deployment back to two replicas;
- nothing of Ray's, Serve's or the replicas' processes listens or connects off loopback.
"""
from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import openai
import pytest

from py_engine import LLM, SamplingParams
from tests.cluster.conftest import engine_replica_pids, wait_for_replicas
from tests.net_sockets import non_loopback_sockets, process_tree

PROMPTS = [f"{name}:" for name in ("ROMEO", "JULIET", "KING HENRY", "HAMLET", "MENENIUS", "First Citizen",
                                   "GLOUCESTER", "BRUTUS")] * 4  # 32
TOKENS = 24


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny-shakespeare")
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    return {p: llm.generate(p, params).text for p in set(PROMPTS)}


async def _stream(client, prompt: str, max_tokens: int = TOKENS, started: list | None = None) -> str:
    text = ""
    stream = await client.completions.create(model="tiny-shakespeare", prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        text += chunk.choices[0].text if chunk.choices else ""
        if started is not None and text:
            started.append(prompt)
            started = None
    return text


@pytest.fixture(scope="module")
def url(cluster):
    return cluster[0]


def test_32_concurrent_streams(url, reference):
    cluster = url
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(_stream(c, p) for p in PROMPTS))

    assert asyncio.run(run()) == [reference[p] for p in PROMPTS]
    routed = _metrics(cluster, "ruvllm_cluster_routed_total")
    assert len({labels.split('"')[1] for labels in routed}) == 2  # both replicas served


def test_affinity_by_user_and_by_prefix(url):
    cluster = url
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0, timeout=120)
    story = "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name. " * 3

    def ask(messages, user=None):
        raw = client.chat.completions.with_raw_response.create(model="tiny-shakespeare", messages=messages,
                                                               max_tokens=8, temperature=0, user=user)
        return raw.headers["x-ruvllm-replica"], raw.headers["x-ruvllm-route"], raw.parse().choices[0].message

    for user in ("ann", None):
        messages = [{"role": "user", "content": story}]
        first, _, reply = ask(messages, user)
        for turn in range(3):
            messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": f"More {turn}"}]
            replica, route, reply = ask(messages, user)
            assert (replica, route) == (first, "user" if user else "prefix")
    metrics = _metrics(cluster, "")
    assert metrics["ruvllm_cluster_replicas"] == 2
    assert sum(v for k, v in metrics.items() if k.startswith("ruvllm_cluster_routed_total") and "prefix" in k) >= 3
    assert metrics["ruvllm_prompt_tokens_total"] > 0  # the replicas' own counters, summed
    assert metrics["ruvllm_prefix_cache_hits_total"] > 0  # turn 2 found turn 1's blocks on its replica


def test_nothing_leaves_loopback(cluster):
    """Every process of the cluster descends from the serve command (it started Ray: GCS, raylet, workers)."""
    pids = process_tree(cluster[1].pid)
    names = " ".join(Path(f"/proc/{p}/cmdline").read_text(errors="replace") for p in pids if Path(f"/proc/{p}").exists())
    assert len(pids) >= 5 and "raylet" in names and "gcs_server" in names
    assert non_loopback_sockets(pids) == []


def test_a_killed_replica_loses_no_request_that_had_not_started(cluster, reference):
    url, process, _ = cluster
    retries_before = _metrics(url, "").get("ruvllm_cluster_retries_total", 0)
    victims = engine_replica_pids(process.pid)
    assert len(victims) == 2

    async def run():
        started: list[str] = []
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300) as c:
            tasks = [asyncio.ensure_future(_stream(c, p, started=started)) for p in PROMPTS]
            while len(started) < 4:  # 4 running per replica (--max-concurrent 4), the rest queued
                await asyncio.sleep(0.05)
            os.kill(victims[0], signal.SIGKILL)  # as a crash would
            return await asyncio.gather(*tasks, return_exceptions=True), started

    results, started = asyncio.run(run())
    failed = [(p, r) for p, r in zip(PROMPTS, results) if isinstance(r, BaseException)]
    for prompt, error in failed:
        assert isinstance(error, openai.APIError) and "replica" in str(error), error
    assert len(failed) <= 4 + 1  # at most the killed replica's running streams
    for prompt, result in zip(PROMPTS, results):
        if not isinstance(result, BaseException):
            assert result == reference[prompt]
    assert _metrics(url, "")["ruvllm_cluster_retries_total"] > retries_before  # queued ones were re-sent
    print(f"{len(failed)} streams ended with an error; replicas back to 2 after {wait_for_replicas(url, 2):.1f} s")
    assert len(engine_replica_pids(process.pid)) == 2


def _metrics(cluster: str, prefix: str) -> dict[str, float]:
    text = httpx.get(f"{cluster}/metrics", timeout=60).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and line.startswith(prefix):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out



def test_sigterm_stops_serve_and_ray(cluster):
    _, process, log = cluster
    process.terminate()
    assert process.wait(90) == 0, log.read_text()[-3000:]
