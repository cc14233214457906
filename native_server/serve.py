"""`ruvllm serve [MODEL]`: load a model into the batching engine and serve OpenAI's API with uvicorn.

Binds 127.0.0.1 unless `--host` says otherwise: the server has no TLS and,
without `--api-key`, no authentication. The API key may also come from
$RUVLLM_API_KEY, which keeps it out of `ps` listings.

Host header: bound to one address, the server answers only requests whose
Host is a loopback name or that address (a web page cannot reach it by DNS
rebinding); `--allowed-hosts` adds names. Bound to every interface (0.0.0.0,
::) without `--allowed-hosts`, any Host is accepted, with a warning.

Chat templates sent by clients (`chat_template_kwargs.chat_template`) are
refused unless `--allow-client-chat-template`: that lets any client run Jinja
on the server. The sandbox blocks reaching out of the template, and every
render (the model's own too) runs in a worker process killed after
`--chat-template-timeout` seconds, with a memory limit; still, a client
could keep the workers busy and slow other chat requests, so allow it only
for clients you trust.

Shutdown (http_server.py): the first SIGTERM or SIGINT stops accepting
connections and requests (503), lets running requests finish for up to
`--shutdown-timeout` seconds, aborts the rest (their streams end with an
error event), then exits with status 0. A second SIGINT exits at once.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
from pathlib import Path
from typing import Any

from native_server.engine.config import EngineConfig, parse_size, positive
from py_engine.hub import BUILTIN_MODEL, load_aliases, resolve_model

logger = logging.getLogger("ruvllm.server")

WEB_DIST = Path(__file__).resolve().parent.parent / "web" / "dist"
__all__ = ["add_serve_parser", "allowed_hosts", "build_server", "parse_serve_args", "parse_size", "run_serve"]


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` on the `ruvllm` command's subparsers."""
    p = subparsers.add_parser("serve", help="serve a model over HTTP with OpenAI's API (chat, completions)",
                              description="Serve a model over HTTP with OpenAI's API: /v1/chat/completions, "
                                          "/v1/completions, /v1/models, /health, /metrics.")
    p.add_argument("model", nargs="?", default=BUILTIN_MODEL, metavar="MODEL",
                   help=f"local dir, alias, cached repo id (default {BUILTIN_MODEL})")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model id clients send and see (default: MODEL; for a folder, its name)")
    p.add_argument("--api-key", default=os.environ.get("RUVLLM_API_KEY") or None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $RUVLLM_API_KEY)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGTERM, seconds running requests get to finish before being aborted (default 10)")
    lora = EngineConfig.add_cli_args(p)
    lora.add_argument("--enable-runtime-lora", action="store_true",
                      help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --lora-dir)")
    lora.add_argument("--lora-dir", type=Path, metavar="DIR",
                      help="with --enable-runtime-lora: the only folder adapters may be loaded from")
    cluster = p.add_argument_group("replicas on Ray Serve (native_server/cluster; pip install 'ruvllm[cluster]')")
    cluster.add_argument("--replicas", type=positive, metavar="N",
                         help="serve N copies of the engine behind one endpoint with Ray Serve, each request routed "
                              "to its user's replica, else the one holding its prompt prefix, else the least loaded")
    cluster.add_argument("--ray-address", metavar="ADDR",
                         help="join a running Ray cluster (ray start --head ...; 'auto' finds a local one); default: "
                              "start Ray on this machine, bound to 127.0.0.1")
    cluster.add_argument("--cpus-per-replica", type=positive, default=1, metavar="C",
                         help="CPUs Ray reserves for each replica, and its torch threads (default 1)")
    cluster.add_argument("--gpus-per-replica", type=float, default=0.0, metavar="G",
                         help="GPUs Ray reserves for each replica (default 0)")
    cluster.add_argument("--routing", default="affinity", choices=["affinity", "random", "round-robin", "least-loaded"],
                         help="affinity: the user's replica, else the one holding the prompt's prefix, else the least "
                              "loaded (default); random, round-robin and least-loaded alone are for A/B measurements")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--metrics-compat", default="none", choices=["none", "vllm"],
                   help="vllm: /metrics also carries vLLM's metric names (vllm:num_requests_running, "
                        "vllm:kv_cache_usage_perc, ...) beside ruvllm_*, for its dashboards and autoscalers")
    p.add_argument("--allowed-hosts", metavar="NAMES",
                   help="comma-separated Host names to answer besides loopback ones, e.g. api.example.com,"
                        "*.internal; '*' for any (default: loopback names and --host)")
    p.add_argument("--allow-client-chat-template", action="store_true",
                   help="RISK: run chat templates that requests send (chat_template_kwargs.chat_template); "
                        "bounded in time and memory, but any client can then keep the template workers busy")
    p.add_argument("--chat-template-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a chat template may take to render before the request gets a 400 (default 10)")
    p.add_argument("--request-body-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a client has to send a request body before a 408 (default 30)")
    p.add_argument("--witness-log", type=Path, metavar="DIR",
                   help="log every request and response as JSON lines in DIR (rotated; never headers or the API "
                        "key) and take ratings and corrections on POST /v1/feedback")
    p.add_argument("--witness-log-file-size", type=parse_size, default=64 << 20, metavar="BYTES",
                   help="start a new witness file past this size (default 64M)")
    p.add_argument("--witness-log-files", type=positive, default=8, metavar="N",
                   help="witness files kept per stream; older ones are deleted (default 8)")
    p.add_argument("--learning", action="store_true",
                   help="learn from POST /v1/feedback (needs --witness-log DIR): each session's MicroLoRA is "
                        "trained at once and its next requests use it; a background loop consolidates all "
                        "feedback into DIR/adapters/sona-vN (EWC), served to every session")
    p.add_argument("--learning-config", type=Path, metavar="JSON",
                   help="the learning loops' settings (py_engine.learning.SonaConfig fields) as a JSON object")
    p.add_argument("--feedback-rate", type=float, default=20.0, metavar="R",
                   help="feedbacks a second the server takes (bursts of 2R); beyond it a 429 (default 20)")
    p.add_argument("--web-dir", type=Path, default=WEB_DIST, metavar="DIR",
                   help="the demo page served at / (default: web/dist, built by `ruvllm web build`)")
    p.set_defaults(func=run_serve)
    return p


def served_name(model: str, path: Path) -> str:
    """The name clients send and see for MODEL when --served-model-name is not given: MODEL itself (an alias, a
    repo id), or for a path on disk its last part without a .gguf suffix (`smol-q4km.gguf` -> `smol-q4km`), never
    the folder it resolved to (a GGUF's is named with a hash) nor where it lies."""
    local = Path(model).expanduser()
    if not local.exists():
        return model
    return local.stem if local.is_file() and local.suffix.lower() == ".gguf" else local.resolve().name or path.name


def _aliases(model: str, path: Path) -> tuple[str, ...]:
    """Other names a request may use for the served model: the MODEL argument, its alias's repo id."""
    alias = load_aliases().get(model.lower())
    return tuple(name for name in (model, alias.repo if alias else None, path.name) if name)


WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def allowed_hosts(host: str, names: str | None) -> tuple[str, ...]:
    """The Host names the server answers: loopback ones, the bound address, and --allowed-hosts."""
    from native_server.api.middleware import LOOPBACK_HOSTS

    extra = tuple(n.strip() for n in (names or "").split(",") if n.strip())
    if host in WILDCARD_HOSTS and not extra:
        logger.warning("--host %s without --allowed-hosts: any Host header is answered; name the ones clients "
                       "use with --allowed-hosts to refuse DNS-rebinding requests", host or "''")
        return ("*",)
    return (*LOOPBACK_HOSTS, *(() if host in WILDCARD_HOSTS else (host,)), *extra)


def _log_configuration(args: argparse.Namespace, path: Path, engine: Any) -> None:
    stats = engine.stats()
    block_size = stats.block_size
    logger.info("model %s (%s), context %d tokens, quantization %s", args.model, path, engine.max_model_len,
                engine.engine.quantization)
    logger.info("KV cache: %d blocks of %d tokens = %d tokens; batch: %d sequences, %d tokens per step; "
                "queue: %d", stats.kv_blocks_total, block_size, stats.kv_blocks_total * block_size,
                args.max_concurrent, engine.max_num_batched_tokens, args.max_queue)
    if stats.kv_cold_blocks_total:
        logger.info("KV cache %s with %d hot tokens: %d hot blocks (%.0f bytes/token) + %d cold blocks (%.0f "
                    "bytes/token) = capacity %d tokens", args.kv_cache_dtype, args.kv_hot_tokens,
                    stats.kv_blocks_total, stats.kv_hot_bytes_per_token, stats.kv_cold_blocks_total,
                    stats.kv_cold_bytes_per_token, stats.kv_capacity_tokens)
    logger.info("listening on http://%s:%d (API key %s)", args.host, args.port,
                "required" if args.api_key else "not required")


def _open_witness_log(ctx: Any, args: argparse.Namespace) -> None:
    from native_server.learning.feedback import FeedbackDesk, FeedbackLimits
    from native_server.learning.witness import WitnessLog

    ctx.witness = WitnessLog(args.witness_log, max_file_bytes=args.witness_log_file_size,
                             max_files=args.witness_log_files)
    if not 0 < args.feedback_rate <= 1e6:
        raise ValueError(f"--feedback-rate: must be in (0, 1e6], got {args.feedback_rate}")
    ctx.feedback = FeedbackDesk(ctx.witness, FeedbackLimits(rate=args.feedback_rate, burst=2 * args.feedback_rate))
    logger.info("witness log: %s (%d files of %d bytes at most per stream); POST /v1/feedback takes ratings",
                args.witness_log, args.witness_log_files, args.witness_log_file_size)


def _learning_config(args: argparse.Namespace) -> Any:
    import json

    from py_engine.learning import SonaConfig

    if args.xlora is not None:
        raise ValueError("--learning serves its adapters as LoRA; it cannot be combined with --xlora")
    raw = json.loads(args.learning_config.read_text(encoding="utf-8")) if args.learning_config else {}
    if not isinstance(raw, dict):
        raise ValueError(f"--learning-config {args.learning_config}: expected a JSON object of SonaConfig fields")
    return SonaConfig.from_dict(raw)


def _start_learning(ctx: Any, args: argparse.Namespace, config: Any, path: Path, engine: Any) -> None:
    from native_server.learning.learner import EngineSlots, Learner
    from py_engine.learning import Sona

    sona = Sona.load(path, config, folder=args.witness_log)
    slots = EngineSlots(engine)
    if sona.consolidated is not None:  # the current version from an earlier run, before the first request
        slots(None, sona.adapter_for(None))
    ctx.learner, ctx.slots = Learner(sona, slots), slots
    ctx.feedback.learner = ctx.learner
    logger.info("learning: on (%s); consolidated adapter %s", sona.config,
                f"sona-v{sona.version}" if sona.version else "none yet")


def build_server(args: argparse.Namespace) -> tuple[Any, Any]:
    """The app and its ServerContext (engine not started: the app's lifespan starts it), from serve's options;
    `ruvllm serve` runs it under uvicorn, each Ray Serve replica (native_server/cluster) in its own process."""
    try:  # the server's dependencies are an extra: the rest of the CLI runs without them
        from native_server.api.app import create_app
    except ImportError as exc:
        raise ImportError(f"`ruvllm serve` needs the server extra: pip install 'ruvllm[server]' ({exc})") from exc
    from native_server.engine.async_engine import AsyncEngine
    from native_server.api.context import ServerContext
    from native_server.engine.llm_engine import LLMEngine

    if args.learning and args.witness_log is None:
        raise ValueError("--learning needs --witness-log DIR (the feedback it learns from and its adapters live "
                         "there)")
    if args.enable_runtime_lora and (args.lora_dir is None or not args.lora_dir.is_dir()):
        raise ValueError("--enable-runtime-lora needs --lora-dir DIR, an existing folder adapters are loaded from")
    sona_config = _learning_config(args) if args.learning else None
    path = resolve_model(args.model, args.cache_dir)
    # A path on disk is nothing for clients to see: a folder or file is served under its own name.
    name = args.served_model_name or served_name(args.model, path)
    config = EngineConfig.from_cli_args(args, model=str(path), served_model_name=name,
                                        enable_lora=args.enable_runtime_lora or args.learning)
    if sona_config is not None:  # room for every session's MicroLoRA and the consolidated versions
        config = config.with_options(max_loras=config.max_loras + 2 * sona_config.max_sessions + 2,
                                     max_lora_rank=max(config.max_lora_rank, sona_config.rank + sona_config.micro_rank))
    engine = LLMEngine(config)
    async_engine = AsyncEngine(engine)
    ctx = ServerContext.for_engine(async_engine, path, name, _aliases(args.model, path),
                                   allow_client_chat_template=args.allow_client_chat_template,
                                   template_timeout=args.chat_template_timeout)
    ctx.lora_dir, ctx.max_lora_rank = args.lora_dir, args.max_lora_rank
    ctx.metrics.compat, ctx.metrics.model_name = args.metrics_compat, name
    if args.witness_log is not None:
        _open_witness_log(ctx, args)
    if args.learning:
        _start_learning(ctx, args, sona_config, path, async_engine)
    _log_configuration(args, path, async_engine)
    if args.allow_client_chat_template:
        logger.warning("--allow-client-chat-template: clients may run their own Jinja chat templates here")
    app = create_app(ctx, api_key=args.api_key, static_dir=args.web_dir, shutdown_timeout=args.shutdown_timeout,
                     body_timeout=args.request_body_timeout, allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
                     runtime_lora=args.enable_runtime_lora)
    return app, ctx


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvicorn

        from native_server.api.http_server import GracefulServer
    except ImportError as exc:
        raise ImportError(f"`ruvllm serve` needs the server extra: pip install 'ruvllm[server]' ({exc})") from exc
    app, ctx = build_server(args)
    # uvicorn's own graceful timeout is the backstop should a connection outlive the engine's drain.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=int(args.shutdown_timeout) + 5, lifespan="on")
    server = GracefulServer(config, ctx, args.shutdown_timeout)
    ctx.engine.on_fatal = server.fail
    # The model, tokenizer and app live as long as the server: out of the collector's sight, a full
    # collection (the periodic one, or after a large body: api/request_body.py) scans only what requests
    # made, ~3 ms instead of ~350 ms of a held GIL.
    gc.collect()
    gc.freeze()
    server.run()
    return server.exit_code


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """`ruvllm serve ARGV...`'s options, parsed as the command line does (Ray Serve replicas use it)."""
    parser = argparse.ArgumentParser(prog="ruvllm")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])
