"""The replicas' routing policy on its own (native_server/cluster/routing.py: no Ray): exact choices."""
from __future__ import annotations

from native_server.cluster.routing import BLOCK_CHARS, AffinityTable, RouteKey, chain, route_key

SYSTEM = {"role": "system", "content": "You are a helpful assistant who answers in verse. " * 6}


def chat(*turns: str) -> dict:
    messages = [SYSTEM]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"messages": messages}


def test_a_conversation_s_next_turn_extends_its_chain():
    one = route_key("/v1/chat/completions", chat("Tell me of the sea. " * 10))
    two = route_key("/v1/chat/completions", chat("Tell me of the sea. " * 10, "The sea is wide. " * 10, "More!"))
    assert len(one.prefix) >= 3 and two.prefix[:len(one.prefix)] == one.prefix
    assert route_key("/v1/completions", {"prompt": "x" * (3 * BLOCK_CHARS + 5)}).prefix == chain("x" * 3 * BLOCK_CHARS)
    assert route_key("/v1/completions", {"prompt": "short"}).prefix == ()
    assert route_key("/v1/completions", {"prompt": "a", "user": "ann"}).user == "ann"
    assert route_key("/v1/completions", "not json") == RouteKey()


def test_user_then_prefix_then_least_loaded():
    table = AffinityTable()
    loads = {"a": 0, "b": 0}
    first = route_key("/v1/chat/completions", chat("Tell me of the sea. " * 10))
    choice = table.choose(first, loads)
    assert (choice.replica, choice.reason) == ("a", "least-loaded")  # ties: fewest routed, then name
    table.record(first, "a")
    loads["a"] = 3
    follow = route_key("/v1/chat/completions", chat("Tell me of the sea. " * 10, "It is deep. " * 10, "And?"))
    assert (table.choose(follow, loads).replica, table.choose(follow, loads).reason) == ("a", "prefix")
    # a new conversation sharing only the system prompt: its blocks are cached on a, which is not 8 ahead: a
    short = route_key("/v1/chat/completions", chat("Something else, briefly."))
    assert (table.choose(short, loads).replica, table.choose(short, loads).reason) == ("a", "prefix")
    other = route_key("/v1/chat/completions", chat("Something else entirely, " * 30))  # mostly its own text
    assert table.choose(other, loads).reason == "least-loaded" and table.choose(other, loads).replica == "b"
    ann = RouteKey(user="ann", prefix=other.prefix)
    table.record(ann, "b")
    loads["b"] = 7
    assert (table.choose(ann, loads).replica, table.choose(ann, loads).reason) == ("b", "user")


def test_imbalance_and_capacity_override_affinity():
    table = AffinityTable(imbalance=2)
    key = route_key("/v1/completions", {"prompt": "y" * 1000})
    table.record(key, "a")
    assert table.choose(key, {"a": 2, "b": 0}).reason == "prefix"
    assert table.choose(key, {"a": 3, "b": 0}).replica == "b"  # more than 2 ahead of the least loaded
    user = RouteKey(user="bob")
    table.record(user, "a")
    assert table.choose(user, {"a": 10, "b": 0}, capacity=10).replica == "b"  # full: not its user's any more


def test_a_dead_replica_is_forgotten():
    table = AffinityTable()
    key = RouteKey(user="cy", prefix=chain("z" * 600))
    table.record(key, "a")
    assert table.choose(key, {"b": 0}).replica == "b"  # a is not among the live ones
    table.forget("a")
    assert not table.users and not table.hashes


def test_tables_are_bounded():
    import native_server.cluster.routing as routing

    table = AffinityTable()
    old = routing.MAX_ENTRIES
    routing.MAX_ENTRIES = 10
    try:
        for i in range(30):
            table.record(RouteKey(prefix=chain(f"{i:04d}" * 40)), "a")
        assert len(table.hashes) == 10
    finally:
        routing.MAX_ENTRIES = old


def test_without_ray_one_clear_error():
    import subprocess
    import sys

    code = ("import sys; sys.modules['ray'] = None\n"
            "from ruvllm_cli.main import main\nsys.exit(main(['serve', '--replicas', '2']))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1].startswith(
        "error: replicas run on Ray Serve, which is not installed: pip install 'ruvllm[cluster]'"), run.stderr


def test_replica_arguments_leave_the_cluster_s_own():
    from native_server.cluster.launch import replica_argv

    argv = ["--verbose", "serve", "tiny-shakespeare", "--replicas", "2", "--port=9000", "--host", "0.0.0.0",
            "--api-key", "k", "--max-concurrent", "8", "--cpus-per-replica", "1"]
    assert replica_argv(argv) == ["tiny-shakespeare", "--max-concurrent", "8"]


def test_metrics_are_summed_and_ratios_recomputed():
    from native_server.cluster.ingress import sum_metrics

    one = ("# TYPE ruvllm_prefix_cache_hits_total counter\nruvllm_prefix_cache_hits_total 30\n"
           "ruvllm_prefix_cache_queries_total 100\nruvllm_prefix_cache_hit_rate 0.3\n"
           "ruvllm_kv_cache_hot_bytes_per_token 1536\nruvllm_ttft_seconds_bucket{le=\"0.1\"} 2\n")
    two = one.replace(" 30\n", " 70\n").replace("0.3", "0.7").replace("{le=\"0.1\"} 2", "{le=\"0.1\"} 5")
    lines = sum_metrics([one, two]).splitlines()
    assert lines == ["# TYPE ruvllm_prefix_cache_hits_total counter", "ruvllm_prefix_cache_hits_total 100",
                     "ruvllm_prefix_cache_queries_total 200", "ruvllm_prefix_cache_hit_rate 0.5",
                     "ruvllm_kv_cache_hot_bytes_per_token 1536", 'ruvllm_ttft_seconds_bucket{le="0.1"} 7']


def test_the_documented_serve_config_is_valid():
    """docs/serve-config.yaml against Ray Serve's own schema, and its args against build_app's options."""
    import pytest
    yaml = pytest.importorskip("yaml", reason="pyyaml comes with Ray Serve: pip install 'ray[serve]'")
    schema = pytest.importorskip("ray.serve.schema", reason="Ray Serve is not installed: pip install 'ray[serve]'")

    from native_server.cluster.app import ClusterOptions
    from tests.paths import REPO

    config = yaml.safe_load((REPO / "docs" / "serve-config.yaml").read_text())
    deploy = schema.ServeDeploySchema.model_validate(config) if hasattr(schema.ServeDeploySchema, "model_validate") \
        else schema.ServeDeploySchema.parse_obj(config)
    app = deploy.applications[0]
    assert app.import_path == "native_server.cluster.app:build_app"
    options = ClusterOptions.from_dict(app.args)
    assert options.serve_args[0] == "smollm2-135m-instruct" and options.replicas == 4
