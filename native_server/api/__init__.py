"""The HTTP side: OpenAI's API (FastAPI) over one `AsyncEngine`.

    app.py                  create_app: the routes, the middleware, the error handlers
    protocol.py             request and response bodies (pydantic): the written contract
    request_body.py         bodies read under bounds (size, time, memory)
    middleware.py           Host allow-list, API key, cross-origin isolation headers
    errors.py               errors in OpenAI's shape, one table of statuses
    context.py              what the handlers share (engine, names, metrics)
    prompts.py              request body -> prompt ids and SamplingParams, every check a 400
    templates.py            chat templates rendered in killable worker processes
    guided.py               structured outputs and tools: plans, grammars compiled off the engine thread
    generation.py           one API request on the engine: its jobs, deltas, usage
    serving.py              what chat and completions share: run to the end, or stream
    serving_chat.py         POST /v1/chat/completions
    serving_completions.py  POST /v1/completions
    streaming.py            server-sent events, client disconnects
    logprobs.py             token logprobs in OpenAI's two shapes
    metrics.py              /metrics in Prometheus' text format
    http_server.py          uvicorn with a draining shutdown

It imports the engine; the engine never imports it.
"""
