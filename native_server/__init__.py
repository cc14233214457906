"""Ring 2: the OpenAI-compatible server (paged KV cache, continuous batching) and its benchmark.

    engine/    LLMEngine and AsyncEngine: scheduler, block manager, KV cache, model runner, sampler,
               LoRA slots; engine/attention/ the paged-attention interface and its backends
    api/       the FastAPI app: OpenAI's routes, request bodies, streaming, templates, errors
    learning/  the witness log, feedback and the learning loops (`serve --learning`)
    bench/     `ruvllm benchmark`: the engine in-process or a server over HTTP
    cluster/   `ruvllm serve --replicas N`: engines behind one endpoint on Ray Serve (Ray optional)
    serve.py   `ruvllm serve`: the command line that builds an engine and serves it

Imports flow engine <- api, learning <- serve <- cluster (tests/rings/test_imports.py).
`add_parser(subparsers)` registers `ruvllm serve` and `ruvllm benchmark` on
the command line; importing this package loads neither torch nor FastAPI.
"""


def add_parser(subparsers) -> None:
    """Register `ruvllm serve` and `ruvllm benchmark` on the command line's subparsers (ruvllm_cli)."""
    from .bench.cli import add_benchmark_parser
    from .serve import add_serve_parser

    add_serve_parser(subparsers).set_defaults(func=_serve)
    add_benchmark_parser(subparsers)


def _serve(args) -> int:
    """`ruvllm serve`: one server, or with --replicas the Ray Serve cluster (which builds servers: serve.py
    does not import cluster/)."""
    if args.replicas:
        import logging

        from .cluster.launch import serve_replicas

        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return serve_replicas(args)
    from .serve import run_serve

    return run_serve(args)
