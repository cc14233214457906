"""Multi-LoRA serving end to end: a real `ruvllm serve --lora-modules ... --enable-runtime-lora` under uvicorn,
driven by the official openai client.

- /v1/models lists the base and each adapter with `parent`;
- ten concurrent requests mixing four adapters and the base (greedy and seeded) each get exactly the
  tokens they get alone;
- an unknown adapter is a 404; bad adapters (DoRA, malformed, outside --lora-dir, a name taken; a file
  linked out of --lora-dir, NaN weights, a target module the model lacks) are 400s naming what is wrong,
  and the server keeps serving;
- unloading an adapter while its requests stream drops none of them; new ones get a 404; loading it
  again serves it again.
"""
from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.paths import BUILTIN
from tests.server.lora_adapters import ADAPTERS, build_adapters, hostile_adapters
from tests.server.server_harness import API_KEY, Server, no_traceback, running_server, wait_until

openai = pytest.importorskip("openai")
pytest.importorskip("peft", reason="peft is in the [test] extra: pip install -e '.[test]'")
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BASE = "tiny-shakespeare"
PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed"]


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loras")
    build_adapters(folder)
    return folder


@pytest.fixture(scope="module")
def server(lora_dir, tmp_path_factory):
    modules = [f"{name}={lora_dir / name}" for name in ADAPTERS]
    with running_server(BUILTIN, "--api-key", API_KEY, "--served-model-name", BASE, "--lora-modules", *modules,
                        "--enable-runtime-lora", "--lora-dir", str(lora_dir), "--max-loras", "6",
                        "--max-lora-rank", "16", "--max-concurrent", "16",
                        log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv
        assert no_traceback(srv.log()), srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: Server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _complete(client, model: str, prompt: str, seeded: bool, max_tokens: int = 10) -> list[str]:
    extra = dict(temperature=0.9, top_p=0.95, seed=5) if seeded else dict(temperature=0)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, logprobs=0,
                                    extra_body={"ignore_eos": True}, **extra)
    assert out.model == model
    return out.choices[0].logprobs.tokens


def test_models_lists_adapters_with_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, *ADAPTERS}
    assert all(cards[name].model_extra["parent"] == BASE for name in ADAPTERS)
    assert cards[BASE].model_extra.get("parent") is None


def test_mixed_batch_gives_each_request_its_solo_tokens(client):
    jobs = [(model, prompt, seeded) for model in (BASE, *ADAPTERS) for prompt in PROMPTS[:1] for seeded in (0, 1)]
    jobs += [(model, PROMPTS[1], 0) for model in (BASE, *ADAPTERS)]
    solo = [_complete(client, *job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        mixed = list(pool.map(lambda job: _complete(client, *job), jobs))
    assert mixed == solo
    greedy = {model: tokens for (model, _, seeded), tokens in zip(jobs, solo) if not seeded}
    assert len({tuple(t) for t in greedy.values()}) > 1, "adapters should change the tokens"


def test_unknown_adapter_is_404_and_bad_adapters_are_400(client, server, lora_dir, tmp_path):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="ROMEO:", max_tokens=2)
    bad = lora_dir / "broken"
    shutil.copytree(lora_dir / "qv", bad)
    (bad / "adapter_config.json").write_text("{not json")
    dora = lora_dir / "dora"
    shutil.copytree(lora_dir / "qv", dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    big = lora_dir / "big"
    shutil.copytree(lora_dir / "qv", big)
    (big / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    outside = tmp_path / "outside"
    shutil.copytree(lora_dir / "qv", outside)
    cases = [({"lora_name": "b", "lora_path": "broken"}, "not valid JSON"),
             ({"lora_name": "d", "lora_path": "dora"}, "DoRA"),
             ({"lora_name": "g", "lora_path": "big"}, "above the limit of 16"),
             ({"lora_name": "o", "lora_path": str(outside)}, "inside the server's --lora-dir"),
             ({"lora_name": "up", "lora_path": f"../{outside.parent.name}/outside"}, "inside the server's --lora-dir"),
             ({"lora_name": "attn", "lora_path": "qv"}, "already loaded"),
             ({"lora_name": "m", "lora_path": "missing"}, "no such adapter folder"),
             ({"lora_name": BASE, "lora_path": "qv"}, "served model's name")]
    cases += [({"lora_name": name, "lora_path": folder}, words)
              for name, (folder, words) in hostile_adapters(lora_dir, "qv", tmp_path).items()]
    for body, words in cases:
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
        assert str(lora_dir) not in r.text
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=AUTH)
    assert r.status_code == 404
    assert _complete(client, "qv", "ROMEO:", False, 2)  # still serving


def test_unload_under_load_drops_no_request_then_load_again(client, server):
    expected = _complete(client, "mlp", PROMPTS[1], False, 48)
    results, errors = [], []

    def stream() -> None:
        try:
            tokens, finish = [], None
            for chunk in client.completions.create(model="mlp", prompt=PROMPTS[1], max_tokens=48, temperature=0,
                                                   logprobs=0, stream=True, extra_body={"ignore_eos": True}):
                tokens += chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else []
                finish = chunk.choices[0].finish_reason or finish
            results.append((tokens, finish))
        except Exception as exc:  # noqa: BLE001: the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=stream) for _ in range(6)]
    for t in threads:
        t.start()
    wait_until(server, lambda m: m.get("ruvllm_num_requests_running", 0) > 0, timeout=60)  # unload mid-stream
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "mlp"}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp", prompt="ROMEO:", max_tokens=2)
    for t in threads:
        t.join(120)
    assert not errors and results == [(expected, "length")] * 6
    assert "mlp" not in {m.id for m in client.models.list().data}
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "mlp2", "lora_path": "mlp"},
                   headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert _complete(client, "mlp2", PROMPTS[1], False, 48) == expected
