"""`ruvllm benchmark`: latency and throughput of the engine in-process or of a running server over HTTP.

stats.py (percentiles, per-request timings) and report.py (table, json, csv)
are stdlib only; offline.py drives an `LLMEngine` in this process;
loadgen.py drives a server's streaming /v1/completions; cli.py is the command.
"""
