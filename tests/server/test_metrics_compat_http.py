"""`--metrics-compat vllm`: /metrics also carries vLLM's metric names (the ones its Grafana dashboard and
autoscalers read), each sample equal to ruvllm's own, with vLLM's model_name label; read with
Prometheus' own exposition parser (prometheus_client) from a real `ruvllm serve`."""
from __future__ import annotations

import httpx
import pytest

from tests.server.server_harness import no_traceback, running_server
from tests.server.test_structured_outputs_http import REPO

parser = pytest.importorskip("prometheus_client.parser")
VLLM = {"vllm:num_requests_running": "ruvllm_num_requests_running",
        "vllm:num_requests_waiting": "ruvllm_num_requests_waiting",
        "vllm:kv_cache_usage_perc": "ruvllm_kv_cache_usage_perc",
        "vllm:prefix_cache_queries": "ruvllm_prefix_cache_queries",
        "vllm:prefix_cache_hits": "ruvllm_prefix_cache_hits",
        "vllm:prompt_tokens": "ruvllm_prompt_tokens",
        "vllm:generation_tokens": "ruvllm_generation_tokens",
        "vllm:request_success": "ruvllm_request_success",
        "vllm:time_to_first_token_seconds": "ruvllm_time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds": "ruvllm_inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds": "ruvllm_e2e_request_latency_seconds"}


def families(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def samples(family, drop: str | None = None) -> list:
    """(suffix after the family's name, labels without `drop`, value) of each sample, sorted."""
    return sorted((s.name[len(family.name):], tuple(sorted((k, v) for k, v in s.labels.items() if k != drop)),
                   s.value) for s in family.samples)


def test_vllm_names_beside_ruvllms(tmp_path):
    model = REPO / "py_engine" / "data" / "tiny-shakespeare"
    with running_server(model, "--metrics-compat", "vllm", "--served-model-name", "tiny", log_dir=tmp_path) as srv:
        for _ in range(2):
            ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 5}, timeout=60)
            assert ok.status_code == 200
        found = families(srv.url)
        for vllm, ours in VLLM.items():
            assert found[vllm].type == found[ours].type, vllm
            assert all(s.labels.get("model_name") == "tiny" for s in found[vllm].samples), vllm
            assert samples(found[vllm], drop="model_name") == samples(found[ours]), vllm
        assert found["vllm:generation_tokens"].samples[0].value == 10
        assert sum(s.value for s in found["vllm:request_success"].samples) == 2
        assert no_traceback(srv.log())
